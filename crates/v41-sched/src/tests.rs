//! Scheduler behaviour, one claim per test (tiny pools: page = 4 tokens, window 6).

use crate::*;

const B: u32 = 4;

fn layout(blocks: u32, rows: u32) -> Layout {
    let kind = |name: &str, r, w| CacheKind {
        name: name.into(),
        tokens_per_block: B,
        tokens_per_entry: r,
        window_tokens: w,
        num_blocks: blocks,
    };
    let state = StateKind {
        name: "cstate".into(),
        state_rows: rows,
    };
    Layout::new(
        vec![kind("swa", 1, Some(6)), kind("ckv2", 2, None)],
        Some(state),
    )
    .unwrap()
}

fn config(budget: u32, seqs: u32) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: budget,
        max_num_seqs: seqs,
        max_model_len: 256,
        long_prefill_token_threshold: None,
        enable_prefix_caching: true,
    }
}

fn sched(blocks: u32, budget: u32, seqs: u32) -> Scheduler {
    Scheduler::new(layout(blocks, 8), config(budget, seqs)).unwrap()
}

fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>, max_tokens: u32) {
    let new = NewRequest {
        id,
        prompt,
        max_tokens,
        priority: 0,
        cache_salt: None,
        lookahead: 0,
    };
    s.add_request(new).unwrap();
}

fn add_with(
    s: &mut Scheduler,
    id: u64,
    prompt: Vec<u32>,
    priority: i32,
    salt: Option<&str>,
    lookahead: u32,
) {
    let new = NewRequest {
        id,
        prompt,
        max_tokens: 4,
        priority,
        cache_salt: salt.map(Into::into),
        lookahead,
    };
    s.add_request(new).unwrap();
}

fn sample(id: u64, token: u32) -> RequestOutput {
    RequestOutput {
        id,
        sampled: vec![token],
        ..Default::default()
    }
}

fn prompt(n: u32, seed: u32) -> Vec<u32> {
    (0..n).map(|i| 1000 * seed + i).collect()
}

#[test]
fn prefill_then_decode_lifecycle() {
    let mut s = sched(64, 64, 4);
    add(&mut s, 7, prompt(10, 1), 3);
    let out = s.step();
    assert_eq!(out.req_ids, [7]);
    assert_eq!((out.num_scheduled[0], out.start_pos[0]), (10, 0));
    assert!(out.is_prefill[0] && out.do_sample[0]);
    assert_eq!(out.positions, (0..10).collect::<Vec<_>>());
    assert_eq!(out.token_ids, prompt(10, 1));
    assert_eq!(out.kinds[0].slot_mapping[..5], [0, 1, 2, 3, 4]);
    s.update_from_output(&[sample(7, 42)]).unwrap();
    let out = s.step();
    assert_eq!(
        (out.num_scheduled[0], out.start_pos[0], out.token_ids[0]),
        (1, 10, 42)
    );
    assert!(!out.is_prefill[0] && out.do_sample[0]);
    s.update_from_output(&[sample(7, 43)]).unwrap();
    s.step();
    s.update_from_output(&[sample(7, 44)]).unwrap();
    assert!(s.request(7).is_none(), "max_tokens reached");
    let out = s.step();
    assert_eq!(out.finished, [(7, FinishReason::Length)]);
    assert!(out.req_ids.is_empty());
    s.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_respects_budget_and_threshold() {
    let mut s = sched(64, 8, 4);
    s.config.long_prefill_token_threshold = Some(5);
    add(&mut s, 1, prompt(12, 1), 4);
    add(&mut s, 2, prompt(12, 2), 4);
    let out = s.step();
    assert_eq!(
        out.num_scheduled,
        [5, 3],
        "threshold 5, then the rest of the budget of 8"
    );
    assert!(!out.do_sample[0] && !out.do_sample[1]);
    s.update_from_output(&[]).unwrap();
    let out = s.step();
    assert_eq!(
        (out.start_pos.clone(), out.num_scheduled.clone()),
        (vec![5, 3], vec![5, 3])
    );
    s.check_invariants().unwrap();
}

#[test]
fn decodes_are_scheduled_before_prefills() {
    let mut s = sched(64, 6, 4);
    add(&mut s, 1, prompt(12, 1), 8);
    add(&mut s, 2, prompt(3, 2), 8);
    let out = s.step(); // 1 gets 6 tokens of its prompt, 2 waits for budget
    assert_eq!(out.req_ids, [1]);
    let out = s.step(); // 1 continues (6 more = done), 2 admitted? budget used up
    assert_eq!(out.req_ids, [1]);
    s.update_from_output(&[sample(1, 5)]).unwrap();
    let out = s.step(); // 1 decodes first, then 2 is admitted with the rest
    assert_eq!(out.req_ids, [1, 2]);
    assert_eq!(out.num_scheduled, [1, 3]);
    s.check_invariants().unwrap();
}

#[test]
fn waiting_requests_are_admitted_by_priority_then_arrival() {
    let mut s = sched(64, 64, 2);
    add_with(&mut s, 1, prompt(4, 1), 5, None, 0);
    add_with(&mut s, 2, prompt(4, 2), -1, None, 0);
    add_with(&mut s, 3, prompt(4, 3), -1, None, 0);
    let out = s.step();
    assert_eq!(
        out.req_ids,
        [2, 3],
        "max_num_seqs = 2, most important first"
    );
}

#[test]
fn swa_blocks_outside_window_are_released() {
    let mut s = sched(64, 64, 4);
    add(&mut s, 1, prompt(17, 1), 8);
    s.step(); // positions 0..17 computed; swa holds blocks 0..=4
    assert_eq!(s.request(1).unwrap().block_tables[0].len(), 5);
    s.update_from_output(&[sample(1, 9)]).unwrap();
    s.step(); // next position 17 attends to 12..=17: blocks 3 and 4 stay
    let req = s.request(1).unwrap();
    assert_eq!(req.block_tables[0][..3], [-1, -1, -1]);
    assert!(req.block_tables[0][3..].iter().all(|&b| b >= 0));
    assert_eq!(
        req.block_tables[1].len(),
        5,
        "ckv2 keeps every entry: 9 entries, 2 per block"
    );
    s.check_invariants().unwrap();
}

#[test]
fn compressed_slot_mapping_marks_only_closing_tokens() {
    let mut s = sched(64, 64, 4);
    add(&mut s, 1, prompt(5, 1), 4);
    let out = s.step();
    let ckv = &out.kinds[1];
    assert_eq!((&ckv.diff_rows, &ckv.diff_cols), (&vec![0], &vec![0]));
    let blk = ckv.diff_blocks[0];
    assert_eq!(ckv.slot_mapping, [-1, blk * 2, -1, blk * 2 + 1, -1]);
    assert_eq!(ckv.max_blocks, 1);
}

#[test]
fn rejected_drafts_roll_back_num_computed() {
    let mut s = sched(64, 64, 4);
    let new = NewRequest {
        id: 1,
        prompt: prompt(6, 1),
        max_tokens: 16,
        priority: 0,
        cache_salt: None,
        lookahead: 3,
    };
    s.add_request(new).unwrap();
    s.step();
    let out = RequestOutput {
        id: 1,
        sampled: vec![50],
        num_accepted_drafts: 0,
        new_draft: vec![51, 52, 53, 54],
    };
    s.update_from_output(&[out]).unwrap();
    assert_eq!(
        s.request(1).unwrap().draft,
        [51, 52, 53],
        "truncated to lookahead"
    );
    let out = s.step();
    assert_eq!(
        (
            out.start_pos[0],
            out.num_scheduled[0],
            out.num_draft_tokens[0]
        ),
        (6, 4, 3)
    );
    assert_eq!(out.token_ids, [50, 51, 52, 53]);
    let res = RequestOutput {
        id: 1,
        sampled: vec![51, 60],
        num_accepted_drafts: 1,
        new_draft: vec![],
    };
    s.update_from_output(&[res]).unwrap();
    let req = s.request(1).unwrap();
    assert_eq!(
        req.num_computed, 8,
        "positions 6, 7 verified; 8 and 9 rejected"
    );
    assert_eq!(req.output(), [50, 51, 60]);
    let out = s.step();
    assert_eq!((out.start_pos[0], out.num_scheduled[0]), (8, 1));
    s.check_invariants().unwrap();
}

#[test]
fn invalid_step_results_are_rejected_without_effect() {
    let mut s = sched(64, 64, 4);
    add_with(&mut s, 1, prompt(6, 1), 0, None, 2);
    s.step();
    let too_many = RequestOutput {
        id: 1,
        sampled: vec![1, 2],
        num_accepted_drafts: 1,
        new_draft: vec![],
    };
    assert!(matches!(
        s.update_from_output(&[too_many]),
        Err(SchedError::InvalidOutput { .. })
    ));
    let none = RequestOutput {
        id: 1,
        ..Default::default()
    };
    assert!(s.update_from_output(&[none]).is_err());
    assert_eq!(s.request(1).unwrap().num_computed, 6);
    s.update_from_output(&[sample(1, 3)]).unwrap();
}

#[test]
fn preemption_picks_lowest_priority_latest_and_recomputes() {
    // 4 blocks per kind: two 8-token prompts fill both pools.
    let mut s = sched(4, 64, 4);
    add_with(&mut s, 1, prompt(8, 1), 0, None, 0);
    add_with(&mut s, 2, prompt(8, 2), 1, None, 0);
    add_with(&mut s, 3, prompt(7, 3), 2, None, 0);
    let out = s.step();
    assert_eq!(out.req_ids, [1, 2], "3 does not fit and waits");
    s.update_from_output(&[sample(1, 1), sample(2, 1)]).unwrap();
    let out = s.step(); // 1 needs a new swa block (position 8): 2 (priority 1) is the victim
    assert_eq!(out.preempted, [2]);
    assert_eq!(out.req_ids, [1]);
    let req2 = s.request(2).unwrap();
    assert_eq!(
        (req2.status, req2.num_computed, req2.output().len()),
        (RequestStatus::Preempted, 0, 1)
    );
    s.check_invariants().unwrap();
}

#[test]
fn preempted_request_reenters_ahead_of_later_arrivals() {
    let mut s = sched(4, 64, 4);
    add(&mut s, 1, prompt(8, 1), 4);
    add(&mut s, 2, prompt(8, 2), 4);
    s.step();
    add(&mut s, 3, prompt(4, 3), 4);
    s.update_from_output(&[sample(1, 1), sample(2, 1)]).unwrap();
    let out = s.step();
    assert_eq!(out.preempted, [2]);
    let order: Vec<u64> = s.waiting.values().map(|&slot| s.req(slot).id).collect();
    assert_eq!(order, [2, 3]);
}

#[test]
fn prefix_hit_reuses_pages_and_is_capped_below_prompt() {
    let mut s = sched(64, 64, 4);
    add(&mut s, 1, prompt(12, 1), 2);
    s.step();
    s.update_from_output(&[sample(1, 5)]).unwrap();
    s.finish_request(1).unwrap();
    add(&mut s, 2, prompt(12, 1), 2);
    let out = s.step();
    assert_eq!(
        out.prefix_hit_tokens,
        [8],
        "3 full pages cached, capped at 11 tokens → 2 pages"
    );
    assert_eq!((out.start_pos[0], out.num_scheduled[0]), (8, 4));
    let mut longer = prompt(12, 1);
    longer.push(77);
    add(&mut s, 3, longer, 2);
    let out = s.step();
    assert_eq!(
        out.req_ids,
        [3],
        "2 has nothing left to compute until its token is reported"
    );
    assert_eq!(out.prefix_hit_tokens, [12]);
    assert_eq!(s.stats().prefix.hit_tokens, 20);
    s.check_invariants().unwrap();
}

#[test]
fn salts_isolate_prefix_hits() {
    let mut s = sched(64, 64, 4);
    add_with(&mut s, 1, prompt(9, 1), 0, Some("a"), 0);
    s.step();
    s.update_from_output(&[sample(1, 5)]).unwrap();
    add_with(&mut s, 2, prompt(9, 1), 0, Some("b"), 0);
    add_with(&mut s, 3, prompt(9, 1), 0, Some("a"), 0);
    let out = s.step();
    assert_eq!(out.req_ids, [1, 2, 3]);
    assert_eq!(out.prefix_hit_tokens, [0, 0, 8]);
}

#[test]
fn identical_prompts_computed_together_end_up_sharing_blocks() {
    let mut s = sched(64, 64, 4);
    add(&mut s, 1, prompt(9, 1), 4);
    add(&mut s, 2, prompt(9, 1), 4);
    s.step();
    s.update_from_output(&[sample(1, 5), sample(2, 6)]).unwrap();
    let used = s.stats().kinds[1].used;
    s.step(); // each computes position 9 (a 3rd ckv2 block); both publish pages 0, 1; 2 switches to 1's
    let (t1, t2) = (
        &s.request(1).unwrap().block_tables[1],
        &s.request(2).unwrap().block_tables[1],
    );
    assert_eq!(t1[..2], t2[..2]);
    assert_eq!(s.stats().kinds[1].used, used + 2 - 2);
    s.check_invariants().unwrap();
}

#[test]
fn abort_frees_everything_and_is_reported() {
    let mut s = sched(64, 4, 4);
    add(&mut s, 1, prompt(12, 1), 4);
    s.step(); // mid-prefill
    s.abort_request(1).unwrap();
    s.reset_prefix_cache();
    let stats = s.stats();
    assert!(stats.kinds.iter().all(|k| k.used == 0));
    assert_eq!(stats.state_rows.unwrap().used, 0);
    assert_eq!(s.step().finished, [(1, FinishReason::Abort)]);
    assert_eq!(
        s.abort_request(1),
        Err(SchedError::UnknownRequest { id: 1 })
    );
    s.check_invariants().unwrap();
}

#[test]
fn requests_that_can_never_fit_are_rejected_naming_the_limit() {
    let mut s = Scheduler::new(layout(4, 8), config(8, 4)).unwrap();
    let err = s
        .add_request(NewRequest {
            id: 1,
            prompt: prompt(250, 1),
            max_tokens: 7,
            priority: 0,
            cache_salt: None,
            lookahead: 0,
        })
        .unwrap_err();
    assert!(err.to_string().contains("max_model_len (256)"), "{err}");
    let err = s
        .add_request(NewRequest {
            id: 2,
            prompt: prompt(20, 1),
            max_tokens: 4,
            priority: 0,
            cache_salt: None,
            lookahead: 0,
        })
        .unwrap_err();
    assert!(
        err.to_string().contains("'ckv2'") && err.to_string().contains("num_blocks=4"),
        "{err}"
    );
    // swa is bounded by its window: a long request fits a small swa pool.
    let mut small_swa = layout(64, 4);
    let mut kinds = small_swa.kinds().to_vec();
    kinds[0].num_blocks = 5;
    small_swa = Layout::new(kinds, small_swa.state().cloned()).unwrap();
    let mut s = Scheduler::new(small_swa, config(8, 4)).unwrap();
    add(&mut s, 3, prompt(100, 1), 20);
    assert!(s
        .add_request(NewRequest {
            id: 3,
            prompt: prompt(1, 1),
            max_tokens: 1,
            priority: 0,
            cache_salt: None,
            lookahead: 0
        })
        .is_err());
}

#[test]
fn state_rows_bound_running_requests() {
    let mut s = Scheduler::new(layout(64, 2), config(64, 8)).unwrap();
    for id in 0..3 {
        add(&mut s, id, prompt(4, id as u32), 4);
    }
    let out = s.step();
    assert_eq!(out.req_ids, [0, 1]);
    let mut rows = out.state_rows.clone();
    rows.sort();
    assert_eq!(rows, [0, 1]);
}

#[test]
fn long_request_runs_alone_in_a_window_sized_swa_pool() {
    let mut kinds = layout(64, 4).kinds().to_vec();
    kinds[0].num_blocks = 5; // window 6 + chunk 8 → at most 5 blocks of 4 tokens
    let mut s = Scheduler::new(Layout::new(kinds, None).unwrap(), config(8, 4)).unwrap();
    add(&mut s, 1, prompt(40, 1), 10);
    for _ in 0..200 {
        let out = s.step();
        s.check_invariants().unwrap();
        let outs: Vec<_> = out
            .req_ids
            .iter()
            .zip(&out.do_sample)
            .filter(|(_, &d)| d)
            .map(|(&id, _)| sample(id, 3))
            .collect();
        s.update_from_output(&outs).unwrap();
        if s.request(1).is_none() {
            return;
        }
    }
    panic!("did not finish");
}

#[test]
fn running_request_pins_its_published_pages_until_it_ends() {
    let mut s = sched(64, 64, 4);
    add(&mut s, 1, prompt(13, 1), 4);
    s.step();
    s.update_from_output(&[sample(1, 5)]).unwrap();
    s.step(); // publishes pages 0..3
    assert_eq!(s.stats().prefix.cached_pages, 3);
    assert_eq!(
        s.reset_prefix_cache(),
        0,
        "a running request's pages are locked"
    );
    s.finish_request(1).unwrap();
    assert_eq!(s.reset_prefix_cache(), 3);
    assert!(s.stats().kinds.iter().all(|k| k.used == 0));
    s.check_invariants().unwrap();
}

#[test]
fn block_table_diffs_carry_only_changes_and_clear_a_reused_row() {
    let mut s = sched(64, 64, 1);
    add(&mut s, 1, prompt(6, 1), 8);
    let out = s.step(); // admission: the whole table, cols 0..2 of row 0
    assert_eq!(out.table_rows, [0]);
    let swa = &out.kinds[0];
    assert_eq!((swa.diff_cols.clone(), swa.max_blocks), (vec![0, 1], 2));
    assert_eq!(swa.diff_blocks, s.request(1).unwrap().block_tables[0]);
    s.update_from_output(&[sample(1, 9)]).unwrap();
    let out = s.step(); // position 6 stays in block 1: nothing changes
    assert!(out.kinds.iter().all(|k| k.diff_rows.is_empty()));
    s.update_from_output(&[sample(1, 9)]).unwrap();
    let out = s.step(); // position 7: still block 1
    assert!(out.kinds[0].diff_rows.is_empty());
    s.update_from_output(&[sample(1, 9)]).unwrap();
    let out = s.step(); // position 8 opens block 2
    assert_eq!(out.kinds[0].diff_cols, [2]);
    s.update_from_output(&[sample(1, 9)]).unwrap();
    s.finish_request(1).unwrap();
    add(&mut s, 2, prompt(3, 2), 4);
    let out = s.step(); // request 2 reuses row 0: its block, then -1 over request 1's tail
    assert_eq!(out.table_rows, [0]);
    let swa = &out.kinds[0];
    assert_eq!(swa.diff_cols, [0, 1, 2]);
    assert_eq!(swa.diff_blocks[1..], [-1, -1]);
    assert_eq!(swa.diff_blocks[0], s.request(2).unwrap().block_tables[0][0]);
    s.check_invariants().unwrap();
}

#[test]
fn stats_tell_blocks_held_only_by_the_prefix_cache_from_blocks_held_by_requests() {
    let mut s = sched(64, 64, 4);
    add(&mut s, 1, prompt(13, 1), 4);
    s.step();
    s.update_from_output(&[sample(1, 5)]).unwrap();
    s.step(); // publishes pages 0..3, which the running request still holds
    let running = s.stats();
    assert_eq!(running.prefix.cached_pages, 3);
    assert!(running.kinds.iter().all(|k| k.cached_only <= k.used));
    assert_eq!(running.kinds[1].cached_only, 0, "ckv2: every cached page is the request's too");
    assert!(running.kinds[1].used > 0);
    s.finish_request(1).unwrap();
    let idle = s.stats();
    assert!(idle.kinds.iter().all(|k| k.used > 0 && k.cached_only == k.used));
    assert_eq!(idle.state_rows.unwrap().cached_only, 0);
    s.reset_prefix_cache();
    assert!(s.stats().kinds.iter().all(|k| k.used == 0 && k.cached_only == 0));
}

#[test]
fn async_scheduling_placeholders_are_replaced_before_they_reach_the_prefix_cache() {
    const PH: u32 = u32::MAX;
    let mut s = sched(64, 64, 4);
    add(&mut s, 1, prompt(7, 1), 4);
    s.step();
    s.update_from_output(&[sample(1, PH)]).unwrap();
    let out = s.step(); // planned before the sampled id is known
    assert_eq!((out.start_pos[0], out.token_ids[0]), (7, PH));
    assert!(s.set_last_token(1, 50).unwrap());
    s.update_from_output(&[sample(1, PH)]).unwrap();
    s.step(); // offers positions 0..8 (the prompt and 50) to the prefix cache
    assert!(s.set_last_token(1, 51).unwrap());
    assert_eq!(s.request(1).unwrap().output(), [50, 51]);
    s.finish_request(1).unwrap();
    assert!(!s.set_last_token(1, 52).unwrap(), "a finished request is ignored");
    let mut next = prompt(7, 1);
    next.extend([50, 51, 60, 61]);
    add(&mut s, 2, next, 2);
    let out = s.step();
    assert_eq!(out.prefix_hit_tokens, [8], "the cached page holds 50, not the placeholder");
    assert!(s.set_last_token(2, 9).is_err(), "no output token yet");
    s.check_invariants().unwrap();
}
