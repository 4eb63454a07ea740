//! `v41-client`: call a v41 gRPC server (`generate`) or load it (`bench`).

use std::io::Write;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use v41_client::bench::{self, BenchConfig};
use v41_client::client::request;
use v41_client::pb::{self, generate_request::Input};
use v41_client::{Client, ClientError};

#[derive(Parser)]
#[command(
    name = "v41-client",
    version,
    about = "Client and load generator of the v41 gRPC API"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one request and print its text, token ids, finish reason, usage and timings.
    Generate(GenerateArgs),
    /// Load the server: N requests at concurrency C, warm-ups excluded, several measured batches.
    Bench(BenchArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// Server address (`v41-serve --grpc` listens on port 8000 by default).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    addr: String,
    /// Raw text prompt (the server prepends BOS; no chat template).
    #[arg(
        long,
        required_unless_present = "token_ids",
        conflicts_with = "token_ids"
    )]
    prompt: Option<String>,
    /// Prompt token ids, comma separated (used as given).
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    token_ids: Option<Vec<u32>>,
    #[arg(long)]
    max_tokens: Option<u32>,
    /// 0 is greedy (server default 1.0).
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    seed: Option<i64>,
    #[arg(long)]
    ignore_eos: bool,
    /// Print the text as it is generated.
    #[arg(long)]
    stream: bool,
    /// Caller-assigned request id (default: assigned by the server).
    #[arg(long, default_value = "")]
    request_id: String,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    addr: String,
    /// Requests per measured batch.
    #[arg(long, default_value_t = 16)]
    num_requests: usize,
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 512)]
    input_len: usize,
    /// Output tokens per request (ignore_eos).
    #[arg(long, default_value_t = 128)]
    output_len: u32,
    /// Warm-up requests, run first and excluded.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measured batches.
    #[arg(long, default_value_t = 3)]
    batches: usize,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

async fn generate(a: GenerateArgs) -> Result<(), ClientError> {
    let mut client = Client::connect(&a.addr).await?;
    let input = match (a.prompt, a.token_ids) {
        (_, Some(ids)) => Input::Tokens(pb::TokenIds { ids }),
        (Some(text), None) => Input::Text(text),
        (None, None) => unreachable!("clap requires --prompt or --token-ids"),
    };
    let params = pb::SamplingParams {
        max_tokens: a.max_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        ignore_eos: a.ignore_eos,
        ..Default::default()
    };
    let mut req = request(input, params, a.stream);
    req.request_id = a.request_id;
    let stdout = std::io::stdout();
    let done = client
        .generate(req, |chunk| {
            let mut out = stdout.lock();
            let _ = out.write_all(chunk.text.as_bytes());
            let _ = out.flush();
        })
        .await?;
    let mut out = stdout.lock();
    for c in done {
        let m = c.complete;
        if !a.stream {
            let _ = write!(out, "{}", m.text);
        }
        let ids: Vec<String> = m.token_ids.iter().map(u32::to_string).collect();
        let u = m.usage.unwrap_or_default();
        let t = m.timings.unwrap_or_default();
        let stop = match m.matched_stop {
            Some(pb::complete::MatchedStop::StopTokenId(id)) => format!(" (stop token {id})"),
            Some(pb::complete::MatchedStop::StopStr(s)) => format!(" (stop string {s:?})"),
            None => String::new(),
        };
        let _ = writeln!(out);
        let _ = writeln!(out, "token_ids: {}", ids.join(" "));
        let _ = writeln!(out, "finish_reason: {}{stop}", m.finish_reason);
        let _ = writeln!(
            out,
            "usage: prompt_tokens={} completion_tokens={} cached_tokens={} reasoning_tokens={}",
            u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens
        );
        let _ = writeln!(
            out,
            "timings: queue_s={:.4} ttft_s={:.4} total_s={:.4}",
            t.queue_s, t.ttft_s, t.total_s
        );
    }
    Ok(())
}

async fn bench(a: BenchArgs) -> Result<(), ClientError> {
    if a.num_requests == 0 || a.concurrency == 0 || a.input_len == 0 || a.output_len == 0 {
        return Err(ClientError::Protocol(
            "--num-requests, --concurrency, --input-len and --output-len must be >= 1".into(),
        ));
    }
    let mut client = Client::connect(&a.addr).await?;
    let cfg = BenchConfig {
        num_requests: a.num_requests,
        concurrency: a.concurrency,
        input_len: a.input_len,
        output_len: a.output_len,
        warmup: a.warmup,
        batches: a.batches,
        seed: a.seed,
    };
    bench::run(&mut client, &cfg, &mut std::io::stdout().lock()).await?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("v41-client: error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Generate(a) => generate(a).await,
            Command::Bench(a) => bench(a).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The whole cause chain: a transport error alone says little ("transport error").
            let mut message = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                let text = cause.to_string();
                if !message.ends_with(&text) {
                    message.push_str(&format!(": {text}"));
                }
                source = cause.source();
            }
            eprintln!("v41-client: error: {message}");
            ExitCode::FAILURE
        }
    }
}
