//! One listener, many connections over verbs: what each connection costs in pinned memory,
//! and how long connecting takes. Runs in the Soft-RoCE VM
//! (`scripts/verbs-test.sh`); elsewhere it says why it skips.
//!
//! Both ends live in this process, so every figure counts a connection twice (its server
//! end and its client end). `IBEX_TEST_CONNS` sets the connection count (default 16).
#![cfg(feature = "verbs")]

use std::time::{Duration, Instant};

use ibex_test_support::pattern;
use ibex_transport::{Config, Connection, connect, listen, verbs};

fn skip() -> bool {
    if std::env::var("RXE_VM").is_err() {
        println!("skipped: no RDMA device (run scripts/verbs-test.sh)");
        return true;
    }
    false
}

/// `VmPin` + `VmLck` of this process, in KiB: what registration pins (rdma-core's pages
/// show as pinned; `mlock`ed ones as locked).
fn pinned_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .filter(|l| l.starts_with("VmPin:") || l.starts_with("VmLck:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
}

fn config(var: &str) -> Config {
    let mut c = Config::from_env().expect("IBEX_* environment variables");
    c.rdma_device = std::env::var(var).ok();
    // No probe: it would add seconds per connection under emulation and measures nothing
    // this test is about.
    c.eager_threshold = Some(16 << 10);
    c.fragment_size = Some(c.default_fragment_size);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_to_one_listener_stay_within_bounded_pinned_memory() {
    if skip() {
        return;
    }
    let n: usize = std::env::var("IBEX_TEST_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let guard = Duration::from_secs(
        std::env::var("IBEX_TEST_GUARD_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(120),
    );
    tokio::time::timeout(guard, run(n))
        .await
        .expect("hang guard");
}

async fn run(n: usize) {
    let at = format!(
        "verbs://{}",
        std::env::var("IBEX_TEST_LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into())
    );
    let listener = listen(&at, config("IBEX_TEST_SERVER_DEV"))
        .await
        .expect("listen");
    let addr = listener.local_uri();
    let base_pin = pinned_kib();
    let base_rss = rss_kib();

    // The server: every accepted connection answers each message with one of equal length
    // (a push, then the pull).
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let c: Connection = listener.accept().await.expect("accept");
            tasks.push(tokio::spawn(async move {
                loop {
                    let m = match c.recv().await {
                        Ok(m) => m,
                        Err(e) => {
                            // The clients close at the end; anything else is worth seeing.
                            if !matches!(e, ibex_transport::error::Error::PeerClosed(_)) {
                                println!("verbs_scale: server end: {e}");
                            }
                            break;
                        }
                    };
                    let reply = pattern(m.len(), m[0].wrapping_add(1));
                    if let Err(e) = c.send(reply).await {
                        println!("verbs_scale: server end, reply: {e}");
                        break;
                    }
                }
            }));
        }
        tasks
    });

    let mut conns = Vec::with_capacity(n);
    let mut connect_ms = Vec::with_capacity(n);
    let start = Instant::now();
    let mut after_first = (0, 0);
    let (mut hits, mut misses) = (0, 0);
    for i in 0..n {
        let t = Instant::now();
        let c = connect(&addr, config("IBEX_TEST_CLIENT_DEV"))
            .await
            .unwrap_or_else(|e| panic!("connection {i} of {n}: {e}"));
        connect_ms.push(t.elapsed().as_secs_f64() * 1e3);
        conns.push(c);
        if i == 0 {
            // Give the server end time to finish its set-up too.
            tokio::time::sleep(Duration::from_millis(200)).await;
            after_first = (pinned_kib(), rss_kib());
        }
    }
    let total = start.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle_pin = pinned_kib();
    let idle_rss = rss_kib();

    // Each connection: a push of 1 MiB (rendezvous: an RDMA READ by the server) and the
    // server's reply of the same size (the pull), then a small eager round trip.
    // In waves of 16: what is measured is the footprint after every connection did a push
    // and a pull, not how much one emulated device takes at once.
    let mut jobs: Vec<tokio::task::JoinHandle<ibex_transport::ConnStats>> = Vec::new();
    for (i, c) in conns.iter().enumerate() {
        if i % 16 == 0 {
            for j in jobs.drain(..) {
                let s = j.await.expect("connection task");
                hits += s.reg_cache_hits + s.exposed_from_pool;
                misses += s.reg_cache_misses;
            }
        }
        let c = c.clone();
        jobs.push(tokio::spawn(async move {
            let push = pattern(1 << 20, i as u8);
            c.send(push.clone()).await.expect("push");
            let pull = c.recv().await.expect("pull");
            assert_eq!(
                pull,
                pattern(1 << 20, (i as u8).wrapping_add(1)),
                "conn {i}"
            );
            c.send(pattern(100, 7)).await.expect("small");
            let small = c.recv().await.expect("small reply");
            assert_eq!(small, pattern(100, 8));
            c.stats()
        }));
    }
    for j in jobs {
        let s = j.await.expect("connection task");
        hits += s.reg_cache_hits + s.exposed_from_pool;
        misses += s.reg_cache_misses;
    }
    let busy_pin = pinned_kib();
    let busy_rss = rss_kib();
    for c in &conns {
        c.close().await;
    }
    drop(conns);
    for t in server.await.expect("server") {
        let _ = t.await;
    }

    connect_ms.sort_by(f64::total_cmp);
    let median = connect_ms[connect_ms.len() / 2];
    let max = connect_ms[connect_ms.len() - 1];
    let per_conn_idle = idle_pin.saturating_sub(base_pin) / n as u64;
    println!(
        "verbs_scale: {n} connections: connect total {:.2} s, median {median:.1} ms, max {max:.1} ms",
        total.as_secs_f64()
    );
    println!(
        "verbs_scale: pinned KiB: before {base_pin}, after 1 conn {}, {n} idle {idle_pin} ({per_conn_idle} per connection, both ends), after push/pull {busy_pin}",
        after_first.0
    );
    println!(
        "verbs_scale: RSS KiB: before {base_rss}, after 1 conn {}, {n} idle {idle_rss}, after push/pull {busy_rss}",
        after_first.1
    );
    println!("verbs_scale: connection stats: registration hits {hits}, misses {misses}");
    for s in verbs::registration_stats() {
        println!("verbs_scale: {s:?}");
    }
    // Both ends of every connection are in this process: 2 MiB per connection is the
    // 1 MiB-per-end bar.
    assert!(
        per_conn_idle <= 2048,
        "an idle connection pins {per_conn_idle} KiB (both ends); the bar is 1 MiB per end"
    );
    assert!(
        busy_pin < 512 << 10,
        "{n} connections pinned {busy_pin} KiB after a push/pull each; the bar is 512 MiB"
    );
}
