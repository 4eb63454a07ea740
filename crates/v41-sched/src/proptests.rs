//! State-machine property tests over random workloads, with a ghost model of KV contents.
//!
//! The ghost model records, for every slot a step writes, a hash of the token prefix (and salt) that
//! produced it; every slot a scheduled request reads (the window before its first position for
//! windowed kinds, every closed entry for compressed kinds) must hold the hash of its own prefix.
//! That catches wrong prefix hits, cross-salt sharing, premature window release, writes into shared
//! blocks and broken slot mappings. The block tables it reads are the consumer's persistent tables,
//! rebuilt from every step's diffs alone, so a missing or stale diff entry fails too. After every
//! operation `check_invariants` runs; at the end the
//! workload must drain within a bounded number of steps and every block must come back.

use std::collections::HashMap;

use proptest::prelude::*;

use crate::*;

const B: u32 = 4;

#[derive(Debug, Clone)]
struct Setup {
    blocks: u32,
    swa_blocks: u32,
    window: u32,
    budget: u32,
    max_seqs: u32,
    rows: Option<u32>,
    threshold: Option<u32>,
    caching: bool,
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        group: u8,
        shared_pages: u8,
        suffix: u8,
        max_tokens: u8,
        priority: i8,
        salt: Option<u8>,
        lookahead: u8,
    },
    Step {
        seed: u64,
    },
    Finish {
        pick: u8,
    },
    Abort {
        pick: u8,
    },
}

fn setup_strategy() -> impl Strategy<Value = Setup> {
    (
        (
            4u32..24,
            3u32..16,
            prop_oneof![Just(1u32), Just(3), Just(6), Just(9)],
        ),
        (
            1u32..24,
            1u32..6,
            proptest::option::of(1u32..5),
            proptest::option::of(1u32..9),
        ),
        prop::bool::weighted(0.85),
    )
        .prop_map(
            |((blocks, swa_blocks, window), (budget, max_seqs, rows, threshold), caching)| Setup {
                blocks,
                swa_blocks,
                window,
                budget,
                max_seqs,
                rows,
                threshold,
                caching,
            },
        )
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let add = (
        0u8..3,
        0u8..5,
        0u8..7,
        1u8..9,
        0i8..3,
        proptest::option::of(0u8..2),
        0u8..4,
    )
        .prop_map(
            |(group, shared_pages, suffix, max_tokens, priority, salt, lookahead)| Op::Add {
                group,
                shared_pages,
                suffix,
                max_tokens,
                priority,
                salt,
                lookahead,
            },
        );
    prop_oneof![
        3 => add,
        6 => any::<u64>().prop_map(|seed| Op::Step { seed }),
        1 => any::<u8>().prop_map(|pick| Op::Finish { pick }),
        1 => any::<u8>().prop_map(|pick| Op::Abort { pick }),
    ]
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Harness {
    s: Scheduler,
    setup: Setup,
    /// Per kind: slot → prefix hash of the token that wrote it.
    ghost: Vec<HashMap<i32, u64>>,
    /// Per kind: the persistent block tables `[row][col]` as the step diffs build them.
    tables: Vec<Vec<Vec<i32>>>,
    live: Vec<u64>,
    next_id: u64,
}

/// Prefix hashes of the known tokens: `h[p]` identifies salt + tokens `0..=p`.
fn prefix_hashes(req: &Request) -> Vec<u64> {
    let mut h = match &req.cache_salt {
        None => 1,
        Some(s) => s
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))),
    };
    (0..req.known_len())
        .map(|p| {
            h = (h ^ u64::from(req.token_at(p)))
                .wrapping_mul(0x100_0000_01B3)
                .rotate_left(17)
                ^ p as u64;
            h
        })
        .collect()
}

impl Harness {
    fn new(setup: Setup) -> Self {
        let kind = |name: &str, r, w, n| CacheKind {
            name: name.into(),
            tokens_per_block: B,
            tokens_per_entry: r,
            window_tokens: w,
            num_blocks: n,
        };
        let kinds = vec![
            kind("swa", 1, Some(setup.window), setup.swa_blocks),
            kind("ckv2", 2, None, setup.blocks),
            kind("idx4", 4, None, setup.blocks),
        ];
        let state = setup.rows.map(|state_rows| StateKind {
            name: "cstate".into(),
            state_rows,
        });
        let config = SchedulerConfig {
            max_num_batched_tokens: setup.budget,
            max_num_seqs: setup.max_seqs,
            max_model_len: 40,
            long_prefill_token_threshold: setup.threshold,
            enable_prefix_caching: setup.caching,
        };
        let s = Scheduler::new(Layout::new(kinds, state).unwrap(), config).unwrap();
        let rows = setup.max_seqs as usize;
        Self {
            s,
            setup,
            ghost: vec![HashMap::new(); 3],
            tables: vec![vec![Vec::new(); rows]; 3],
            live: Vec::new(),
            next_id: 0,
        }
    }

    fn pick(&mut self, pick: u8) -> Option<u64> {
        self.live.retain(|&id| self.s.request(id).is_some());
        (!self.live.is_empty()).then(|| self.live[pick as usize % self.live.len()])
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Add {
                group,
                shared_pages,
                suffix,
                max_tokens,
                priority,
                salt,
                lookahead,
            } => {
                let mut prompt: Vec<u32> = (0..u32::from(shared_pages) * B)
                    .map(|i| u32::from(group) * 100 + i)
                    .collect();
                prompt.extend((0..u32::from(suffix)).map(|i| (i * 3 + u32::from(group)) % 5));
                if prompt.is_empty() {
                    prompt.push(1);
                }
                let id = self.next_id;
                self.next_id += 1;
                let new = NewRequest {
                    id,
                    prompt,
                    max_tokens: u32::from(max_tokens),
                    priority: i32::from(priority),
                    cache_salt: salt.map(|s| format!("salt{s}")),
                    lookahead: u32::from(lookahead),
                };
                match self.s.add_request(new) {
                    Ok(()) => self.live.push(id),
                    Err(SchedError::ExceedsPool { .. } | SchedError::ExceedsMaxModelLen { .. }) => {
                    }
                    Err(e) => panic!("unexpected add error: {e}"),
                }
            }
            Op::Step { seed } => {
                self.step(seed);
            }
            Op::Finish { pick } => {
                if let Some(id) = self.pick(pick) {
                    self.s.finish_request(id).unwrap();
                }
            }
            Op::Abort { pick } => match self.pick(pick) {
                Some(id) => self.s.abort_request(id).unwrap(),
                None => assert!(self.s.abort_request(u64::MAX).is_err()),
            },
        }
        self.s.check_invariants().unwrap();
    }

    /// One step plus its update; returns the ends reported by the step.
    fn step(&mut self, seed: u64) -> Vec<(u64, FinishReason)> {
        let out = self.s.step();
        let total: u32 = out.num_scheduled.iter().sum();
        assert!(total <= self.setup.budget, "token budget exceeded");
        assert_eq!(total as usize, out.num_tokens());
        assert!(out.num_reqs() <= self.setup.max_seqs as usize);
        assert!(self.s.stats().num_running <= self.setup.max_seqs as usize);
        self.s.check_invariants().unwrap();
        self.apply_table_diffs(&out);
        self.check_reads_then_write(&out);
        let mut rng = seed;
        let mut outputs = Vec::new();
        for i in 0..out.num_reqs() {
            let id = out.req_ids[i];
            if !out.do_sample[i] {
                if splitmix(&mut rng) % 2 == 0 {
                    outputs.push(RequestOutput {
                        id,
                        ..Default::default()
                    });
                }
                continue;
            }
            let req = self.s.request(id).unwrap();
            let accepted = (splitmix(&mut rng) % (u64::from(out.num_draft_tokens[i]) + 1)) as usize;
            let mut sampled = req.draft[..accepted].to_vec();
            sampled.push((splitmix(&mut rng) % 4) as u32);
            let draft_len = splitmix(&mut rng) % (u64::from(req.lookahead) + 2);
            let new_draft = (0..draft_len)
                .map(|_| (splitmix(&mut rng) % 4) as u32)
                .collect();
            outputs.push(RequestOutput {
                id,
                sampled,
                num_accepted_drafts: accepted as u32,
                new_draft,
            });
        }
        self.s.update_from_output(&outputs).unwrap();
        out.finished
    }

    /// Applies the step's diffs to the persistent tables; each scheduled request's row must then be
    /// its block table, `-1` beyond.
    fn apply_table_diffs(&mut self, out: &StepOutput) {
        for (k, ks) in out.kinds.iter().enumerate() {
            assert_eq!(ks.diff_rows.len(), ks.diff_cols.len());
            assert_eq!(ks.diff_rows.len(), ks.diff_blocks.len());
            for ((&r, &c), &blk) in ks.diff_rows.iter().zip(&ks.diff_cols).zip(&ks.diff_blocks) {
                let row = &mut self.tables[k][r as usize];
                if row.len() <= c as usize {
                    row.resize(c as usize + 1, -1);
                }
                row[c as usize] = blk;
            }
            for (i, &id) in out.req_ids.iter().enumerate() {
                let table = &self.s.request(id).unwrap().block_tables[k];
                let row = &self.tables[k][out.table_rows[i] as usize];
                assert!(ks.max_blocks >= table.len());
                assert_eq!(
                    &row[..table.len().min(row.len())],
                    &table[..],
                    "request {id} kind {k}"
                );
                assert!(row.len() >= table.len() && row[table.len()..].iter().all(|&b| b < 0));
            }
        }
    }

    /// Ghost-model reads of every scheduled request, then its writes.
    fn check_reads_then_write(&mut self, out: &StepOutput) {
        let kinds = self.s.layout().kinds().to_vec();
        let mut writes = Vec::new();
        let mut t0 = 0;
        for i in 0..out.num_reqs() {
            let req = self.s.request(out.req_ids[i]).unwrap();
            let hashes = prefix_hashes(req);
            let (start, n) = (out.start_pos[i] as usize, out.num_scheduled[i] as usize);
            let hit = out.prefix_hit_tokens[i] as usize;
            assert!(
                hit % B as usize == 0 && (hit == 0 || hit < req.committed_len()),
                "bad hit {hit}"
            );
            for (k, kind) in kinds.iter().enumerate() {
                let ks = &out.kinds[k];
                let row = &self.tables[k][out.table_rows[i] as usize];
                let (r, e) = (
                    kind.tokens_per_entry as usize,
                    kind.entries_per_block() as usize,
                );
                let first_read = kind
                    .window_tokens
                    .map_or(0, |w| (start + 1).saturating_sub(w as usize));
                for (pos, expected) in hashes.iter().enumerate().take(start).skip(first_read) {
                    if (pos + 1) % r != 0 {
                        continue;
                    }
                    let entry = (pos + 1) / r - 1;
                    let blk = row.get(entry / e).copied().unwrap_or(-1);
                    assert!(
                        blk >= 0,
                        "request {} reads kind {k} pos {pos} through a missing block",
                        req.id
                    );
                    let slot = blk * e as i32 + (entry % e) as i32;
                    assert_eq!(
                        self.ghost[k].get(&slot),
                        Some(expected),
                        "request {} kind {} pos {pos}: wrong KV (hit {hit})",
                        req.id,
                        kind.name
                    );
                }
                for t in 0..n {
                    let pos = start + t;
                    assert_eq!(out.positions[t0 + t] as usize, pos);
                    assert_eq!(out.token_ids[t0 + t], req.token_at(pos));
                    let slot = ks.slot_mapping[t0 + t];
                    assert_eq!(
                        slot >= 0,
                        (pos + 1) % r == 0,
                        "slot mapping of kind {k} at {pos}"
                    );
                    if slot >= 0 {
                        let blk = slot / e as i32;
                        assert_eq!(row[((pos + 1) / r - 1) / e], blk);
                        assert_eq!(
                            self.s.block_ref_count(k, blk),
                            1,
                            "write into a shared block"
                        );
                        writes.push((k, slot, hashes[pos]));
                    }
                }
            }
            t0 += n;
        }
        for (k, slot, h) in writes {
            self.ghost[k].insert(slot, h);
        }
    }

    fn drain(&mut self) -> u64 {
        for _ in 0..2000 {
            let stats = self.s.stats();
            if stats.num_running + stats.num_waiting == 0 {
                self.s.step(); // report the last finishes
                self.s.reset_prefix_cache();
                let stats = self.s.stats();
                assert!(
                    stats.kinds.iter().all(|k| k.used == 0),
                    "blocks leaked: {stats:?}"
                );
                assert!(stats.state_rows.is_none_or(|r| r.used == 0));
                self.s.check_invariants().unwrap();
                return stats.num_preemptions;
            }
            self.step(stats.num_running as u64 * 7919 + stats.num_waiting as u64);
            self.s.check_invariants().unwrap();
        }
        panic!("workload did not drain in 2000 steps: {:?}", self.s.stats());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_invariants_and_drain(setup in setup_strategy(), ops in prop::collection::vec(op_strategy(), 1..80)) {
        let mut h = Harness::new(setup);
        for op in &ops {
            h.apply(op);
        }
        let preemptions = h.drain();
        if std::env::var("V41_PROPTEST_STATS").is_ok() {
            let p = h.s.stats().prefix;
            eprintln!("ops {} preemptions {preemptions} hit {}/{}", ops.len(), p.hit_tokens, p.query_tokens);
        }
    }
}

fn tiny_setup_strategy() -> impl Strategy<Value = Setup> {
    (
        4u32..9,
        3u32..7,
        2u32..6,
        2u32..12,
        proptest::option::of(1u32..4),
    )
        .prop_map(|(blocks, swa_blocks, max_seqs, budget, rows)| Setup {
            blocks,
            swa_blocks,
            window: 3,
            budget,
            max_seqs,
            rows,
            threshold: None,
            caching: true,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn tiny_pools_preempt_and_still_drain(setup in tiny_setup_strategy(), ops in prop::collection::vec(op_strategy(), 20..80)) {
        let mut h = Harness::new(setup);
        for op in &ops {
            h.apply(op);
        }
        let preemptions = h.drain();
        if std::env::var("V41_PROPTEST_STATS").is_ok() {
            eprintln!("tiny ops {} preemptions {preemptions}", ops.len());
        }
    }
}

#[test]
fn finished_and_aborted_ids_are_reported_once() {
    let setup = Setup {
        blocks: 16,
        swa_blocks: 8,
        window: 6,
        budget: 8,
        max_seqs: 4,
        rows: Some(2),
        threshold: None,
        caching: true,
    };
    let mut h = Harness::new(setup);
    for op in [
        Op::Add {
            group: 0,
            shared_pages: 2,
            suffix: 1,
            max_tokens: 2,
            priority: 0,
            salt: None,
            lookahead: 1,
        },
        Op::Add {
            group: 0,
            shared_pages: 2,
            suffix: 3,
            max_tokens: 2,
            priority: 0,
            salt: None,
            lookahead: 0,
        },
        Op::Step { seed: 1 },
        Op::Abort { pick: 1 },
    ] {
        h.apply(&op);
    }
    assert_eq!(h.step(2), [(1, FinishReason::Abort)]);
    assert!(h.step(3).is_empty());
    h.drain();
}
