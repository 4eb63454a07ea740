//! Applying a step's results: committed tokens, accepted drafts, next drafts, length finish.
//!
//! `num_computed` already advanced by the scheduled count when the step was planned. A request whose
//! chunk reached its last committed token (`do_sample`) reports `1 + accepted` committed tokens: the
//! accepted drafts (which must equal the drafts it was given) and one sampled token. Rejected drafts
//! (`scheduled drafts − accepted`) are rolled back from `num_computed`; their KV slots are simply
//! overwritten later. A partial prefill chunk reports nothing (or an empty entry).
//!
//! Async scheduling (the engine plans step N + 1 before step N's sampled ids reach the host) reports a
//! placeholder id for each sampled token, plans the next step (which feeds the placeholder as its input),
//! then replaces it with [`Scheduler::set_last_token`] once the id is known — before the step after that
//! is planned. A plan offers pages to the prefix cache only up to `num_computed` as the previous plan left
//! it, which stops before the placeholder's position, so the placeholder is never published; and it is
//! never fed to a recompute after preemption (a step that preempts admits nobody, and the id is in place
//! before the next plan).

use crate::error::SchedError;
use crate::request::{FinishReason, RequestStatus};
use crate::scheduler::Scheduler;

/// One request's result of the last step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestOutput {
    /// Request id.
    pub id: u64,
    /// Committed tokens of this step: the accepted drafts followed by the sampled token
    /// (`num_accepted_drafts + 1` tokens when the step sampled, else none).
    pub sampled: Vec<u32>,
    /// Drafts accepted by verification (≤ drafts scheduled for this request).
    pub num_accepted_drafts: u32,
    /// Drafts to schedule after the new last token (truncated to the request's lookahead).
    pub new_draft: Vec<u32>,
}

impl Scheduler {
    /// Applies the results of the last step. Entries for requests that are no longer running
    /// (aborted or finished since the step) are ignored. All entries are validated before any is
    /// applied. Requests reaching `max_tokens` finish with reason `length` (output truncated there).
    ///
    /// # Errors
    /// [`SchedError::InvalidOutput`] if an entry contradicts the plan: the request was not scheduled,
    /// appears twice, accepts more drafts than scheduled, reports accepted tokens that differ from
    /// its drafts, or reports a token count other than `accepted + 1` (sampled) / 0 (partial prefill).
    pub fn update_from_output(&mut self, outputs: &[RequestOutput]) -> Result<(), SchedError> {
        let mut seen = vec![false; self.slots.len()];
        let mut todo = Vec::with_capacity(outputs.len());
        for out in outputs {
            let bad = |reason: String| Err(SchedError::InvalidOutput { id: out.id, reason });
            let Some(&slot) = self.index.get(&out.id) else {
                continue;
            };
            let req = self.req(slot);
            if req.status != RequestStatus::Running {
                continue;
            }
            if std::mem::replace(&mut seen[slot as usize], true) {
                return bad("appears twice".into());
            }
            if req.scheduled_tokens == 0 {
                return bad("was not scheduled in the last step".into());
            }
            let accepted = out.num_accepted_drafts;
            if accepted > req.scheduled_drafts {
                return bad(format!(
                    "accepted {accepted} drafts but {} were scheduled",
                    req.scheduled_drafts
                ));
            }
            if req.num_computed >= req.committed_len() {
                if out.sampled.len() != accepted as usize + 1 {
                    return bad(format!(
                        "expected {} committed tokens, got {}",
                        accepted + 1,
                        out.sampled.len()
                    ));
                }
                if accepted > 0
                    && out.sampled[..accepted as usize] != req.draft[..accepted as usize]
                {
                    return bad("accepted tokens differ from the scheduled drafts".into());
                }
            } else if !out.sampled.is_empty() || accepted > 0 || !out.new_draft.is_empty() {
                return bad("a partial prefill chunk samples nothing".into());
            }
            todo.push((slot, out));
        }
        for (slot, out) in todo {
            let req = self.req_mut(slot);
            req.num_computed -= (req.scheduled_drafts - out.num_accepted_drafts) as usize;
            req.scheduled_tokens = 0;
            req.scheduled_drafts = 0;
            req.draft.clear();
            let room = (req.max_tokens as usize).saturating_sub(req.output().len());
            req.token_ids
                .extend_from_slice(&out.sampled[..out.sampled.len().min(room)]);
            if req.output().len() >= req.max_tokens as usize {
                self.end_request(slot, FinishReason::Length);
                continue;
            }
            let keep = out.new_draft.len().min(req.draft_limit());
            req.draft.extend_from_slice(&out.new_draft[..keep]);
        }
        Ok(())
    }

    /// Replaces the last committed token of request `id` (a placeholder reported by async scheduling, see
    /// the module docs) with `token`. Returns false, changing nothing, when the request is no longer
    /// waiting or running (it finished or was aborted meanwhile).
    ///
    /// # Errors
    /// [`SchedError::InvalidOutput`] if the request has no output token, or if its last token already
    /// sits in a page offered to the prefix cache (the id came too late: a step was planned after it).
    pub fn set_last_token(&mut self, id: u64, token: u32) -> Result<bool, SchedError> {
        let Some(&slot) = self.index.get(&id) else {
            return Ok(false);
        };
        let page = self.geometry.page.get();
        let req = self.req_mut(slot);
        let bad = |reason: &str| Err(SchedError::InvalidOutput { id, reason: reason.into() });
        if req.output().is_empty() {
            return bad("set_last_token: the request has no output token");
        }
        if req.cached_pages as usize * page >= req.committed_len() {
            return bad("set_last_token: the last token was already offered to the prefix cache");
        }
        *req.token_ids.last_mut().expect("an output token") = token;
        Ok(true)
    }
}
