//! Micro-benchmarks of the verbs link, for `scripts/verbs-test.sh --bench`, which runs them in
//! the Soft-RoCE VM next to perftest and reports ratios. They are `#[ignore]`d: they measure,
//! they do not judge (no timing is asserted), and they need the VM (`RXE_VM=1`).
#![cfg(feature = "verbs")]

use std::future::poll_fn;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ibex_transport::Config;
use ibex_transport::link::{Link, LinkEvent};
use ibex_transport::verbs::{self, VerbsLink, VerbsOptions};

/// Progress modes: `event` (default 20 µs spin, then sleep), `spin2ms` (event mode with a
/// 2 ms spin budget), `busy` (dedicated busy-poll thread).
fn opts(mode: &str) -> Option<(VerbsOptions, VerbsOptions)> {
    if std::env::var("RXE_VM").is_err() {
        println!("skipped: no RDMA device (run scripts/verbs-test.sh --bench)");
        return None;
    }
    let dev = |v: &str| {
        std::env::var(v)
            .ok()
            .or_else(|| std::env::var("RXE_DEV").ok())
    };
    let base = VerbsOptions {
        busy_poll: mode == "busy",
        spin: if mode == "spin2ms" {
            Duration::from_millis(2)
        } else {
            VerbsOptions::default().spin
        },
        ..VerbsOptions::default()
    };
    Some((
        VerbsOptions {
            device: dev("IBEX_TEST_SERVER_DEV"),
            ..base.clone()
        },
        VerbsOptions {
            device: dev("IBEX_TEST_CLIENT_DEV"),
            ..base
        },
    ))
}

async fn pair(mode: &str) -> Option<(VerbsLink, VerbsLink)> {
    let (so, co) = opts(mode)?;
    let cfg = Config {
        slot_size: 16 << 10,
        credits: 32,
        pool_size: 64 << 20,
        ..Config::default()
    };
    let l = verbs::listen_with("127.0.0.1:0", &cfg, so)
        .await
        .expect("listen");
    let addr = l.local_addr().to_string();
    let (s, c) = tokio::join!(l.accept(), verbs::connect_with(&addr, &cfg, co));
    Some((s.expect("accept"), c.expect("connect")))
}

async fn recv_frame(link: &mut VerbsLink) -> Bytes {
    match poll_fn(|cx| link.poll_event(cx)).await.expect("event") {
        LinkEvent::Frame(b) => b,
        other => panic!("expected a frame, got {other:?}"),
    }
}

/// Ping-pong of 64-byte frames; one-way latency = round trip / 2, like perftest's send_lat.
async fn latency(mode: &str) {
    let Some((mut s, mut c)) = pair(mode).await else {
        return;
    };
    let iters = 2000;
    let msg = [7u8; 64];
    let echo = async move {
        for _ in 0..iters {
            let f = recv_frame(&mut s).await;
            poll_fn(|cx| s.poll_send(cx, &f)).await.expect("echo");
        }
        s
    };
    let ping = async move {
        let mut rtts = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            poll_fn(|cx| c.poll_send(cx, &msg)).await.expect("ping");
            let f = recv_frame(&mut c).await;
            assert_eq!(f.len(), 64);
            rtts.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
        (c, rtts)
    };
    // The echo side runs on its own worker thread, as the peer process would.
    let echo = tokio::spawn(echo);
    let (_c, mut lat) = ping.await;
    let _s = echo.await.expect("echo task");
    lat.sort_by(f64::total_cmp);
    let avg = lat.iter().sum::<f64>() / lat.len() as f64;
    println!("BENCH lat_{mode}_typical_us {:.2}", lat[lat.len() / 2]);
    println!("BENCH lat_{mode}_avg_us {avg:.2}");
}

/// RDMA READ rendezvous: 512 KiB fragments, 8 in flight, like the driver's defaults.
async fn bandwidth(mode: &str) {
    let Some((mut s, mut c)) = pair(mode).await else {
        return;
    };
    let len = 16 << 20;
    let frag = 512 << 10;
    let rounds = 4;
    let data = Bytes::from(vec![0x5au8; len]);
    let exp = s.expose(data).expect("expose");
    let mut dst = c.alloc_recv(len).expect("alloc_recv");
    let t = Instant::now();
    for _ in 0..rounds {
        let n = len / frag;
        let mut next = 0;
        let mut done = 0;
        while done < n {
            while next < n && next - done < 8.min(c.read_depth()) {
                // SAFETY: `dst` outlives all reads (we wait for every ReadDone) and the link.
                unsafe {
                    c.post_read(
                        next as u64,
                        &exp.descriptor,
                        (next * frag) as u64,
                        dst.as_mut_ptr().add(next * frag),
                        frag,
                    )
                }
                .expect("post_read");
                next += 1;
            }
            match poll_fn(|cx| c.poll_event(cx)).await.expect("event") {
                LinkEvent::ReadDone { result, .. } => {
                    result.expect("read");
                    done += 1;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    assert!(dst.as_slice().iter().all(|&b| b == 0x5a));
    println!(
        "BENCH read_bw_{mode}_MBps {:.1}",
        (len * rounds) as f64 / secs / 1e6
    );
    drop(s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: scripts/verbs-test.sh --bench"]
async fn bench_latency_event() {
    latency("event").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: scripts/verbs-test.sh --bench"]
async fn bench_latency_spin_2ms() {
    latency("spin2ms").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: scripts/verbs-test.sh --bench"]
async fn bench_latency_busy_poll() {
    latency("busy").await;
}

#[tokio::test]
#[ignore = "benchmark: scripts/verbs-test.sh --bench"]
async fn bench_read_bandwidth_event() {
    bandwidth("event").await;
}

#[tokio::test]
#[ignore = "benchmark: scripts/verbs-test.sh --bench"]
async fn bench_read_bandwidth_busy_poll() {
    bandwidth("busy").await;
}
