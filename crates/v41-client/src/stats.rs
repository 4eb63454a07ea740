//! Statistics of `v41-client bench`: percentiles and decode throughput in the full-concurrency window.

/// Linearly interpolated percentile (`q` in [0, 100], numpy's default method); `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 100.0) / 100.0) * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(v[lo] + (v[hi] - v[lo]) * (rank - lo as f64))
}

/// One request's decode timeline, seconds from the start of the phase.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DecodeTrace {
    /// When its first output token arrived (the end of its prefill).
    pub first_token_s: f64,
    /// When its last output token arrived.
    pub end_s: f64,
    /// `(arrival, tokens)` of every later chunk: the decode tokens.
    pub chunks: Vec<(f64, u64)>,
}

/// Decode tokens and seconds inside the full-concurrency window: the time during which
/// `min(width, traces.len())` requests were decoding at once (the seed's "common-active window",
/// generalised to more requests than slots). A chunk counts when it arrives inside the window.
pub fn full_concurrency_decode(traces: &[DecodeTrace], width: usize) -> (u64, f64) {
    let width = width.min(traces.len()) as i64;
    if width == 0 {
        return (0, 0.0);
    }
    // Sweep: +1 when a request starts decoding, -1 when it ends (ends first at equal times).
    let mut events: Vec<(f64, i64)> = traces
        .iter()
        .flat_map(|t| [(t.first_token_s, 1), (t.end_s, -1)])
        .collect();
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut windows: Vec<(f64, f64)> = Vec::new();
    let (mut active, mut opened) = (0i64, None);
    for (t, d) in events {
        active += d;
        match opened {
            None if active >= width => opened = Some(t),
            Some(start) if active < width => {
                if t > start {
                    windows.push((start, t));
                }
                opened = None;
            }
            _ => {}
        }
    }
    let seconds = windows.iter().map(|(a, b)| b - a).sum();
    let inside = |t: f64| windows.iter().any(|&(a, b)| t > a && t <= b);
    let tokens = traces
        .iter()
        .flat_map(|t| t.chunks.iter())
        .filter(|&&(t, _)| inside(t))
        .map(|&(_, n)| n)
        .sum();
    (tokens, seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_like_numpy() {
        let v = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert!((percentile(&v, 95.0).unwrap() - 3.85).abs() < 1e-12);
        assert_eq!(percentile(&[], 50.0), None);
    }

    fn trace(first: f64, end: f64, every: f64) -> DecodeTrace {
        let n = ((end - first) / every).round() as usize;
        let chunks = (1..=n).map(|k| (first + k as f64 * every, 1)).collect();
        DecodeTrace {
            first_token_s: first,
            end_s: end,
            chunks,
        }
    }

    #[test]
    fn window_is_where_every_request_decodes() {
        // Two requests decoding one token per 0.1 s; both active only in [1, 2].
        let traces = [trace(0.0, 2.0, 0.1), trace(1.0, 3.0, 0.1)];
        let (tokens, seconds) = full_concurrency_decode(&traces, 8);
        assert!((seconds - 1.0).abs() < 1e-9);
        assert_eq!(tokens, 20); // 10 per request in (1, 2]
    }

    #[test]
    fn more_requests_than_slots_use_every_full_interval() {
        // Width 1: any decoding request fills the window; the idle gap [1, 2] is excluded.
        let traces = [trace(0.0, 1.0, 0.25), trace(2.0, 3.0, 0.25)];
        let (tokens, seconds) = full_concurrency_decode(&traces, 1);
        assert!((seconds - 2.0).abs() < 1e-9);
        assert_eq!(tokens, 8);
    }

    #[test]
    fn no_overlap_gives_an_empty_window() {
        let traces = [trace(0.0, 1.0, 0.5), trace(2.0, 3.0, 0.5)];
        assert_eq!(full_concurrency_decode(&traces, 2), (0, 0.0));
        assert_eq!(full_concurrency_decode(&[], 2), (0, 0.0));
    }
}
