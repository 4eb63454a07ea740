//! `v41-client bench`: a load generator after the seed document's method
//! (aphrodite-engine PR #1788, "Performance"; docs/benchmarking.md).
//!
//! Every batch sends `num_requests` requests at `concurrency` in two phases over the same fresh random
//! prompts of `input_len` tokens:
//! 1. **prefill**: cold one-token requests (`max_tokens` 1). Prefill tok/s = uncached prompt tokens /
//!    phase wall time; TTFT (request sent → first token) comes from these cold requests.
//! 2. **decode**: the same prompts again (warm prefixes) with `output_len` tokens, `ignore_eos`.
//!    Decode tok/s counts the tokens that arrive while `min(concurrency, num_requests)` requests decode
//!    at once (the common-active window); TPOT = (last token − first token) / (tokens − 1) per request;
//!    acceptance is pooled over draft tokens when the server reports speculative decoding.
//!
//! `warmup` requests run both phases first and are excluded; `batches` measured batches follow.
//! Requests are greedy (temperature 0) with token-id input, so no tokenizer is involved.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::task::JoinSet;

use crate::client::{request, Client};
use crate::error::ClientError;
use crate::pb::{self, generate_request::Input, generate_response::Response};
use crate::stats::{full_concurrency_decode, percentile, DecodeTrace};

/// What to run (the `bench` subcommand's flags).
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub num_requests: usize,
    pub concurrency: usize,
    pub input_len: usize,
    pub output_len: u32,
    pub warmup: usize,
    pub batches: usize,
    pub seed: u64,
}

/// One request as the client saw it; times in seconds from the start of its phase.
#[derive(Clone, Debug, Default)]
struct Trace {
    sent_s: f64,
    first_token_s: Option<f64>,
    last_token_s: f64,
    chunks: Vec<(f64, u64)>,
    completion_tokens: u64,
    uncached_prompt_tokens: u64,
    spec: Option<pb::SpecDecodeStats>,
}

/// The measurements of one batch.
#[derive(Clone, Debug, Default)]
pub struct BatchResult {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub ttft_s: Vec<f64>,
    pub tpot_s: Vec<f64>,
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    /// Σ committed tokens and Σ verification steps of requests that report an acceptance length.
    pub spec_tokens: f64,
    pub spec_steps: f64,
}

impl BatchResult {
    /// Pooled acceptance length (committed tokens per verification step); `None` without speculation.
    pub fn acceptance_length(&self) -> Option<f64> {
        (self.spec_steps > 0.0).then(|| self.spec_tokens / self.spec_steps)
    }
}

/// xorshift64*: reproducible prompts without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// `count` prompts of `len` ids: BOS (when the model has one) then random ids that are not BOS, EOS or pad.
fn prompts(info: &pb::ModelInfo, count: usize, len: usize, rng: &mut Rng) -> Vec<Vec<u32>> {
    let mut special: Vec<u32> = info.eos_token_ids.clone();
    special.extend(info.bos_token_id);
    special.extend(info.pad_token_id);
    let vocab = u64::from(info.vocab_size.max(1));
    (0..count)
        .map(|_| {
            let mut ids: Vec<u32> = info.bos_token_id.into_iter().take(len).collect();
            while ids.len() < len {
                let id = (rng.next() % vocab) as u32;
                if !special.contains(&id) {
                    ids.push(id);
                }
            }
            ids
        })
        .collect()
}

async fn run_one(
    mut client: Client,
    prompt: Vec<u32>,
    max_tokens: u32,
    t0: Instant,
) -> Result<Trace, ClientError> {
    let params = pb::SamplingParams {
        temperature: Some(0.0),
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..Default::default()
    };
    let mut trace = Trace {
        sent_s: t0.elapsed().as_secs_f64(),
        ..Default::default()
    };
    let mut stream = client
        .generate_stream(request(
            Input::Tokens(pb::TokenIds { ids: prompt }),
            params,
            true,
        ))
        .await?;
    while let Some(msg) = stream.message().await? {
        let now = t0.elapsed().as_secs_f64();
        match msg.response {
            Some(Response::Chunk(c)) if !c.token_ids.is_empty() => {
                let n = c.token_ids.len() as u64;
                if trace.first_token_s.is_none() {
                    trace.first_token_s = Some(now);
                } else {
                    trace.chunks.push((now, n));
                }
                trace.last_token_s = now;
            }
            Some(Response::Complete(c)) => {
                let usage = c.usage.unwrap_or_default();
                trace.completion_tokens = u64::from(usage.completion_tokens);
                trace.uncached_prompt_tokens =
                    u64::from(usage.prompt_tokens.saturating_sub(usage.cached_tokens));
                trace.spec = c
                    .spec_decode
                    .filter(|s| s.drafted_tokens > 0 || s.mean_acceptance_length > 0.0);
                return Ok(trace);
            }
            _ => {}
        }
    }
    Err(ClientError::Protocol(
        "stream ended without Complete".into(),
    ))
}

/// Run `prompts` at `concurrency`; returns the traces (prompt order) and the phase's wall time.
async fn run_phase(
    client: &Client,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    concurrency: usize,
) -> Result<(Vec<Trace>, f64), ClientError> {
    let t0 = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let prompts = Arc::new(prompts.to_vec());
    let mut workers = JoinSet::new();
    for _ in 0..concurrency.clamp(1, prompts.len().max(1)) {
        let (client, next, prompts) = (client.clone(), next.clone(), prompts.clone());
        workers.spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = prompts.get(i) else {
                    return Ok::<_, ClientError>(done);
                };
                done.push((i, run_one(client.clone(), p.clone(), max_tokens, t0).await?));
            }
        });
    }
    let mut traces: Vec<(usize, Trace)> = Vec::with_capacity(prompts.len());
    while let Some(res) = workers.join_next().await {
        traces.extend(res.map_err(|e| ClientError::Protocol(format!("worker failed: {e}")))??);
    }
    traces.sort_by_key(|(i, _)| *i);
    Ok((
        traces.into_iter().map(|(_, t)| t).collect(),
        t0.elapsed().as_secs_f64(),
    ))
}

async fn run_batch(
    client: &Client,
    cfg: &BenchConfig,
    prompts: &[Vec<u32>],
) -> Result<BatchResult, ClientError> {
    let mut r = BatchResult::default();
    let (cold, wall) = run_phase(client, prompts, 1, cfg.concurrency).await?;
    let prefill_tokens: u64 = cold.iter().map(|t| t.uncached_prompt_tokens).sum();
    r.prefill_tok_s = prefill_tokens as f64 / wall.max(1e-9);
    r.ttft_s = cold
        .iter()
        .filter_map(|t| t.first_token_s.map(|f| f - t.sent_s))
        .collect();

    let (warm, _) = run_phase(client, prompts, cfg.output_len, cfg.concurrency).await?;
    let decode: Vec<DecodeTrace> = warm
        .iter()
        .filter_map(|t| {
            let first = t.first_token_s?;
            Some(DecodeTrace {
                first_token_s: first,
                end_s: t.last_token_s,
                chunks: t.chunks.clone(),
            })
        })
        .collect();
    let (mut tokens, mut seconds) = full_concurrency_decode(&decode, cfg.concurrency);
    if seconds <= 0.0 {
        // No instant with every slot decoding (e.g. one-token outputs): use the whole decode span.
        tokens = decode
            .iter()
            .flat_map(|d| d.chunks.iter())
            .map(|c| c.1)
            .sum();
        let start = decode
            .iter()
            .map(|d| d.first_token_s)
            .fold(f64::INFINITY, f64::min);
        let end = decode.iter().map(|d| d.end_s).fold(0.0, f64::max);
        seconds = (end - start).max(0.0);
    }
    r.decode_tok_s = if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    };
    for t in &warm {
        if let (Some(first), true) = (t.first_token_s, t.completion_tokens > 1) {
            r.tpot_s
                .push((t.last_token_s - first) / (t.completion_tokens - 1) as f64);
        }
        if let Some(s) = &t.spec {
            r.drafted_tokens += s.drafted_tokens;
            r.accepted_tokens += s.accepted_tokens;
            if s.mean_acceptance_length > 0.0 {
                r.spec_tokens += t.completion_tokens as f64;
                r.spec_steps += t.completion_tokens as f64 / s.mean_acceptance_length;
            }
        }
    }
    Ok(r)
}

fn fmt_opt(v: Option<f64>, scale: f64, prec: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{:.*}", prec, x * scale))
}

fn row(out: &mut impl Write, label: &str, r: &BatchResult) -> std::io::Result<()> {
    let accept = match (r.acceptance_length(), r.drafted_tokens) {
        (Some(len), d) if d > 0 => format!(
            "{len:.2} ({:.1}%)",
            100.0 * r.accepted_tokens as f64 / d as f64
        ),
        (Some(len), _) => format!("{len:.2}"),
        (None, _) => "-".to_string(),
    };
    writeln!(
        out,
        "{label:<7} {:>14.1} {:>13.1} {:>11} {:>11} {:>12} {:>14}",
        r.prefill_tok_s,
        r.decode_tok_s,
        fmt_opt(percentile(&r.ttft_s, 50.0), 1.0, 4),
        fmt_opt(percentile(&r.ttft_s, 95.0), 1.0, 4),
        fmt_opt(percentile(&r.tpot_s, 50.0), 1e3, 2),
        accept
    )
}

/// Run the benchmark against `client`, printing the table to `out`; returns the measured batches.
pub async fn run(
    client: &mut Client,
    cfg: &BenchConfig,
    out: &mut impl Write,
) -> Result<Vec<BatchResult>, ClientError> {
    let info = client.model_info().await?;
    let io = |e: std::io::Error| ClientError::Protocol(format!("cannot write the report: {e}"));
    writeln!(
        out,
        "v41-client bench: model {} ({}), {} requests x {} batches, concurrency {}, input {} tokens, output {} tokens, {} warm-up requests",
        info.served_model_name, info.architecture, cfg.num_requests, cfg.batches, cfg.concurrency,
        cfg.input_len, cfg.output_len, cfg.warmup
    )
    .map_err(io)?;
    let mut rng = Rng(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    if cfg.warmup > 0 {
        let warm = prompts(&info, cfg.warmup, cfg.input_len, &mut rng);
        run_batch(
            client,
            &BenchConfig {
                concurrency: cfg.concurrency.min(cfg.warmup),
                ..cfg.clone()
            },
            &warm,
        )
        .await?;
    }
    writeln!(
        out,
        "{:<7} {:>14} {:>13} {:>11} {:>11} {:>12} {:>14}",
        "batch",
        "prefill tok/s",
        "decode tok/s",
        "TTFT p50 s",
        "TTFT p95 s",
        "TPOT p50 ms",
        "accept len"
    )
    .map_err(io)?;
    let mut results = Vec::with_capacity(cfg.batches);
    for b in 0..cfg.batches {
        let batch = prompts(&info, cfg.num_requests, cfg.input_len, &mut rng);
        let r = run_batch(client, cfg, &batch).await?;
        row(out, &format!("{}", b + 1), &r).map_err(io)?;
        results.push(r);
    }
    if !results.is_empty() {
        let n = results.len() as f64;
        let pooled = BatchResult {
            prefill_tok_s: results.iter().map(|r| r.prefill_tok_s).sum::<f64>() / n,
            decode_tok_s: results.iter().map(|r| r.decode_tok_s).sum::<f64>() / n,
            ttft_s: results
                .iter()
                .flat_map(|r| r.ttft_s.iter().copied())
                .collect(),
            tpot_s: results
                .iter()
                .flat_map(|r| r.tpot_s.iter().copied())
                .collect(),
            drafted_tokens: results.iter().map(|r| r.drafted_tokens).sum(),
            accepted_tokens: results.iter().map(|r| r.accepted_tokens).sum(),
            spec_tokens: results.iter().map(|r| r.spec_tokens).sum(),
            spec_steps: results.iter().map(|r| r.spec_steps).sum(),
        };
        row(out, "all", &pooled).map_err(io)?;
        writeln!(out, "(all: mean rates over batches; TTFT/TPOT percentiles and acceptance pooled over requests)")
            .map_err(io)?;
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> pb::ModelInfo {
        pb::ModelInfo {
            vocab_size: 16,
            eos_token_ids: vec![1],
            bos_token_id: Some(0),
            pad_token_id: Some(2),
            ..Default::default()
        }
    }

    #[test]
    fn prompts_start_with_bos_and_avoid_special_ids() {
        let ps = prompts(&info(), 3, 20, &mut Rng(7));
        assert_eq!(ps.len(), 3);
        for p in &ps {
            assert_eq!(p.len(), 20);
            assert_eq!(p[0], 0);
            assert!(p[1..].iter().all(|&t| t > 2 && t < 16));
        }
        assert_ne!(ps[0], ps[1]);
    }

    #[test]
    fn acceptance_length_is_absent_without_speculation() {
        assert_eq!(BatchResult::default().acceptance_length(), None);
        let r = BatchResult {
            spec_tokens: 30.0,
            spec_steps: 10.0,
            ..Default::default()
        };
        assert_eq!(r.acceptance_length(), Some(3.0));
    }
}
