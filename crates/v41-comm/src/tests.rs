//! Ranks are threads, each with its own `Communicator` (its own mapping) on a file in a temporary
//! directory (under /dev/shm when it exists). Liveness by pid is covered from Python (processes).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::reduce::{bf16_to_f32, f32_to_bf16};
use crate::{CommError, Communicator};

pub(crate) const T: Option<Duration> = Some(Duration::from_secs(10));

pub(crate) fn tmpdir() -> tempfile::TempDir {
    if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    }
}

/// Run `f(comm)` on `world` rank threads joined at a fresh segment; results in rank order.
pub(crate) fn run_ranks<R: Send>(
    world: usize,
    lane_bytes: usize,
    f: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let dir = tmpdir();
    let path = dir.path().join("seg");
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (path, f) = (&path, &f);
                s.spawn(move || f(Communicator::join(path, rank, world, lane_bytes, T).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Deterministic values with magnitudes from 1e-3 to 1e3, so summation order matters.
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let unit = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            unit * 10f32.powi((x % 7) as i32 - 3)
        })
        .collect()
}

pub(crate) fn reference_f32(inputs: &[Vec<f32>]) -> Vec<f32> {
    (0..inputs[0].len())
        .map(|i| inputs[1..].iter().fold(inputs[0][i], |acc, x| acc + x[i]))
        .collect()
}

pub(crate) fn reference_bf16(inputs: &[Vec<u16>]) -> Vec<u16> {
    (0..inputs[0].len())
        .map(|i| {
            let first = bf16_to_f32(inputs[0][i]);
            f32_to_bf16(
                inputs[1..]
                    .iter()
                    .fold(first, |acc, x| acc + bf16_to_f32(x[i])),
            )
        })
        .collect()
}

pub(crate) fn reduce_f32(world: usize, lane_bytes: usize, inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    run_ranks(world, lane_bytes, |mut c| {
        let mut buf = inputs[c.rank()].clone();
        c.all_reduce_f32(&mut buf, T).unwrap();
        buf
    })
}

pub(crate) fn reduce_bf16(world: usize, lane_bytes: usize, inputs: &[Vec<u16>]) -> Vec<Vec<u16>> {
    run_ranks(world, lane_bytes, |mut c| {
        let mut buf = inputs[c.rank()].clone();
        c.all_reduce_bf16(&mut buf, T).unwrap();
        buf
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bf16_inputs(world: usize, n: usize) -> Vec<Vec<u16>> {
    (0..world)
        .map(|r| {
            values(n, 100 + r as u64)
                .into_iter()
                .map(f32_to_bf16)
                .collect()
        })
        .collect()
}

#[test]
fn all_reduce_f32_equals_fixed_order_sum_on_every_rank() {
    for world in 1..=4 {
        let inputs: Vec<_> = (0..world).map(|r| values(1001, r as u64)).collect();
        let expected = bits(&reference_f32(&inputs));
        for out in reduce_f32(world, 1024, &inputs) {
            assert_eq!(bits(&out), expected, "world {world}");
        }
    }
}

#[test]
fn all_reduce_bf16_equals_fixed_order_sum_rounded_once_on_every_rank() {
    for world in 1..=4 {
        let inputs = bf16_inputs(world, 777);
        let expected = reference_bf16(&inputs);
        for out in reduce_bf16(world, 512, &inputs) {
            assert_eq!(out, expected, "world {world}");
        }
    }
}

#[test]
fn all_reduce_is_close_to_the_f64_sum() {
    let inputs: Vec<_> = (0..4).map(|r| values(4096, 7 + r)).collect();
    let out = &reduce_f32(4, 1 << 14, &inputs)[0];
    for (i, &got) in out.iter().enumerate() {
        let exact: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
        let scale: f64 = inputs.iter().map(|x| f64::from(x[i]).abs()).sum();
        assert!((f64::from(got) - exact).abs() <= 4.0 * f64::from(f32::EPSILON) * scale);
    }
}

#[test]
fn all_reduce_bytes_do_not_depend_on_chunking() {
    let inputs: Vec<_> = (0..3).map(|r| values(5000, 40 + r)).collect();
    let many_chunks = reduce_f32(3, 64, &inputs); // 16 elements per round
    let one_chunk = reduce_f32(3, 1 << 16, &inputs);
    assert_eq!(bits(&many_chunks[0]), bits(&one_chunk[0]));
    let inputs = bf16_inputs(3, 5000);
    assert_eq!(
        reduce_bf16(3, 64, &inputs)[2],
        reduce_bf16(3, 1 << 16, &inputs)[2]
    );
}

#[test]
fn all_reduce_of_an_empty_buffer_is_a_round_trip() {
    let out = reduce_f32(3, 64, &[vec![], vec![], vec![]]);
    assert!(out.iter().all(Vec::is_empty));
}

#[test]
fn all_gather_places_each_rank_in_its_block() {
    for (n, lane) in [(0, 64), (5, 64), (1000, 64), (1000, 4096)] {
        let outs = run_ranks(3, lane, |mut c| {
            let input: Vec<u8> = (0..n).map(|i| (i * 7 + c.rank() * 31) as u8).collect();
            let mut out = vec![0u8; 3 * n];
            c.all_gather_bytes(&input, &mut out, T).unwrap();
            out
        });
        let expected: Vec<u8> = (0..3)
            .flat_map(|r| (0..n).map(move |i| (i * 7 + r * 31) as u8))
            .collect();
        assert!(outs.iter().all(|o| *o == expected), "n {n} lane {lane}");
    }
}

#[test]
fn broadcast_delivers_empty_small_and_multi_lane_messages() {
    for n in [0usize, 13, 64, 1000] {
        let msg: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let got = run_ranks(4, 64, |mut c| {
            if c.rank() == 2 {
                c.broadcast_send(&msg, T).unwrap();
                msg.clone()
            } else {
                c.broadcast_recv(2, T).unwrap()
            }
        });
        assert!(got.iter().all(|g| *g == msg), "n {n}");
    }
}

#[test]
fn back_to_back_mixed_collectives_stay_consistent() {
    // One-barrier rounds (gather, broadcast) right after two-barrier ones exercise the parity rule.
    let outs = run_ranks(3, 128, |mut c| {
        let r = c.rank();
        let mut log = Vec::new();
        for it in 0..60usize {
            let n = (it * 37) % 300;
            let mut x: Vec<f32> = (0..n).map(|i| (i + r * 1000 + it) as f32).collect();
            c.all_reduce_f32(&mut x, T).unwrap();
            log.extend(x.iter().map(|v| v.to_bits() as u8));
            let mut g = vec![0u8; 3 * n];
            c.all_gather_bytes(&vec![(r + it) as u8; n], &mut g, T)
                .unwrap();
            log.extend(&g);
            let root = it % 3;
            let msg = if r == root {
                let m = vec![it as u8; n];
                c.broadcast_send(&m, T).unwrap();
                m
            } else {
                c.broadcast_recv(root, T).unwrap()
            };
            log.extend(msg);
            if it % 10 == 0 {
                c.barrier(T).unwrap();
            }
        }
        assert_eq!(c.seq(), 60 * 3 + 6);
        log
    });
    assert!(outs.iter().all(|o| *o == outs[0]));
}

/// Joins `world` ranks; `idle` ranks only hold their communicator until the others are done.
fn with_idle_ranks<R: Send>(
    world: usize,
    idle: &[usize],
    f: impl Fn(&mut Communicator) -> R + Sync,
) -> Vec<Option<R>> {
    let dir = tmpdir();
    let path = dir.path().join("seg");
    let done = std::sync::Barrier::new(world);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (path, f, done) = (&path, &f, &done);
                s.spawn(move || {
                    let mut c = Communicator::join(path, rank, world, 256, T).unwrap();
                    let out = (!idle.contains(&rank)).then(|| f(&mut c));
                    done.wait();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn lagging_rank_times_out_naming_it_within_the_deadline() {
    let deadline = Duration::from_millis(300);
    let outs = with_idle_ranks(3, &[1], |c| {
        let start = Instant::now();
        let err = c
            .all_reduce_f32(&mut [1.0; 100], Some(deadline))
            .unwrap_err();
        (err, start.elapsed())
    });
    for (err, took) in outs.into_iter().flatten() {
        assert!(
            matches!(&err, CommError::Timeout { lagging, .. } if *lagging == vec![1]),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.starts_with(
                "all_reduce #1: timed out after 0.3 s waiting for rank(s) [1] (alive but lagging)"
            ),
            "{msg}"
        );
        assert!(
            took >= deadline && took < deadline + Duration::from_millis(500),
            "{took:?}"
        );
    }
}

#[test]
fn departed_rank_is_named_instead_of_a_timeout() {
    let outs = with_idle_ranks(2, &[], |c| {
        if c.rank() == 1 {
            c.close();
            return None;
        }
        let start = Instant::now();
        let err = c
            .all_reduce_f32(&mut [1.0; 10], Some(Duration::from_secs(5)))
            .unwrap_err();
        Some((err, start.elapsed()))
    });
    let (err, took) = outs.into_iter().next().flatten().flatten().unwrap();
    let pid = std::process::id();
    assert_eq!(
        err.to_string(),
        format!("all_reduce #1: rank 1 (pid {pid}) left")
    );
    assert!(took < Duration::from_secs(1));
}

#[test]
fn a_failed_communicator_is_poisoned_and_peers_see_it_leave() {
    // Rank 0 gives up in the first barrier of the all-reduce; rank 1 arrives late, passes that
    // barrier (rank 0 had arrived) and is told at the second one that rank 0 left.
    let outs = with_idle_ranks(2, &[], |c| {
        if c.rank() == 0 {
            let first = c.all_reduce_f32(&mut [0.0; 4], Some(Duration::from_millis(50)));
            let second = c.barrier(T).unwrap_err().to_string();
            (first.unwrap_err().to_string(), second)
        } else {
            std::thread::sleep(Duration::from_millis(200));
            let late = c.all_reduce_f32(&mut [0.0; 4], T).unwrap_err();
            (late.to_string(), String::new())
        }
    });
    let (first, second) = outs[0].clone().unwrap();
    assert!(first.starts_with("all_reduce #1: timed out"), "{first}");
    assert_eq!(
        second,
        format!("communicator unusable after an earlier error: {first}")
    );
    let (late, _) = outs[1].clone().unwrap();
    let pid = std::process::id();
    assert_eq!(late, format!("all_reduce #1: rank 0 (pid {pid}) left"));
}

#[test]
fn ranks_calling_different_collectives_get_a_mismatch() {
    let outs = with_idle_ranks(2, &[], |c| {
        let err = if c.rank() == 0 {
            c.all_reduce_f32(&mut [0.0; 10], T).unwrap_err()
        } else {
            c.all_reduce_f32(&mut [0.0; 12], T).unwrap_err()
        };
        err.to_string()
    });
    assert_eq!(
        outs[0].as_deref(),
        Some("all_reduce #1: rank 1 disagrees: it is in all_reduce #1 (float32, 12 elements), this rank in all_reduce #1 (float32, 10 elements)")
    );
    let outs = with_idle_ranks(2, &[], |c| {
        if c.rank() == 0 {
            c.broadcast_send(b"x", T).unwrap_err().to_string()
        } else {
            c.barrier(T).unwrap_err().to_string()
        }
    });
    assert!(outs[1]
        .as_deref()
        .unwrap()
        .contains("it is in broadcast #1 (root 0, 1 bytes), this rank in barrier #1"));
}

#[test]
fn a_rank_that_never_joins_is_named() {
    let dir = tmpdir();
    let path = dir.path().join("seg");
    let short = Some(Duration::from_millis(200));
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let path = &path;
                s.spawn(move || {
                    Communicator::join(path, rank, 3, 64, short)
                        .err()
                        .unwrap()
                        .to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errs {
        assert!(
            e.starts_with("join #0: timed out after 0.2 s waiting for rank(s) [2] (not joined)"),
            "{e}"
        );
    }
    assert!(!path.exists(), "rank 0 removes the file name");
    let err = Communicator::join(&path, 1, 2, 64, short).err().unwrap();
    assert!(
        err.to_string()
            .contains("waiting for rank(s) [0] (not joined)"),
        "{err}"
    );
}

#[test]
fn header_mismatch_is_an_error_not_a_hang() {
    let dir = tmpdir();
    let path: PathBuf = dir.path().join("seg");
    std::thread::scope(|s| {
        let rank0 = s.spawn(|| Communicator::join(&path, 0, 2, 4096, T).map(|c| c.seq()));
        let err = Communicator::join(&path, 1, 3, 4096, T)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("world_size 2, lane_bytes 4096; this rank wants version 1, world_size 3"),
            "{err}"
        );
        let err = Communicator::join(&path, 1, 2, 8192, T)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("lane_bytes 8192"), "{err}");
        let ok = Communicator::join(&path, 1, 2, 4096, T).unwrap();
        assert_eq!(rank0.join().unwrap().unwrap(), 0);
        drop(ok);
    });
}

#[test]
fn bad_arguments_are_invalid_argument_errors() {
    let dir = tmpdir();
    let p = dir.path().join("seg");
    for (rank, world, lane) in [(2, 2, 64), (0, 0, 64), (0, 1, 100), (0, 1, 0)] {
        let err = Communicator::join(&p, rank, world, lane, T).err().unwrap();
        assert!(matches!(err, CommError::InvalidArgument(_)), "{err}");
    }
    let mut c = Communicator::join(&p, 0, 1, 64, T).unwrap();
    let err = c.all_gather_bytes(&[1, 2], &mut [0; 3], T).unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument(_)));
    assert!(matches!(
        c.broadcast_recv(5, T),
        Err(CommError::InvalidArgument(_))
    ));
    assert_eq!(c.seq(), 0, "argument errors start no collective");
    c.barrier(T).unwrap();
    c.close();
    assert!(matches!(c.barrier(T), Err(CommError::Closed)));
}

#[test]
fn join_replaces_a_stale_file() {
    let dir = tmpdir();
    let path = dir.path().join("seg");
    std::fs::write(&path, vec![7u8; 10_000]).unwrap();
    let outs = {
        let p = &path;
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| s.spawn(move || Communicator::join(p, r, 2, 64, T).map(|c| c.rank())))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(outs, vec![0, 1]);
}
