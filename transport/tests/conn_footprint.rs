//! What an idle and a busy connection cost in memory on shm and tcp (docs/verbs.md's table; the
//! verbs figures come from `verbs_scale` in the Soft-RoCE VM). Both ends live in this
//! process, so each figure counts a connection's two ends. `IBEX_TEST_CONNS` sets the
//! count (default 16); run with `--nocapture` to see the numbers.

mod conn_util;

use std::time::{Duration, Instant};

use conn_util::{fixed_threshold, pattern, uri};
use ibex_transport::{Connection, connect, listen};

fn status_kib(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
}

/// Shared-memory mappings (memfd segments) of this process and their total size, in KiB.
fn memfd_maps() -> (usize, u64) {
    let s = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut n = 0;
    let mut kib = 0;
    for l in s.lines().filter(|l| l.contains("/memfd:")) {
        n += 1;
        if let Some((a, b)) = l.split_whitespace().next().and_then(|r| r.split_once('-'))
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            kib += (b - a) / 1024;
        }
    }
    (n, kib)
}

/// How many of this process's mappings are shm pools (ours and the peers').
fn pool_maps() -> usize {
    let s = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    s.lines()
        .filter(|l| l.contains("/memfd:ibex-shm-pool"))
        .count()
}

async fn footprint(provider: &str) {
    let n: usize = std::env::var("IBEX_TEST_CONNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let config = fixed_threshold(16 << 10);
    let l = listen(&uri(provider, "footprint"), config.clone())
        .await
        .expect("listen");
    let at = l.local_uri();
    let server = tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let c: Connection = l.accept().await.expect("accept");
            tasks.push(tokio::spawn(async move {
                while let Ok(m) = c.recv().await {
                    if c.send(pattern(m.len(), 1)).await.is_err() {
                        break;
                    }
                }
            }));
        }
        tasks
    });
    let (rss0, maps0, pools0) = (status_kib("VmRSS:"), memfd_maps(), pool_maps());
    let start = Instant::now();
    let mut conns = Vec::new();
    for _ in 0..n {
        conns.push(connect(&at, config.clone()).await.expect("connect"));
    }
    let connect = start.elapsed();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (rss1, maps1, pools1) = (status_kib("VmRSS:"), memfd_maps(), pool_maps());
    let mut jobs = Vec::new();
    for c in &conns {
        let c = c.clone();
        jobs.push(tokio::spawn(async move {
            c.send(pattern(1 << 20, 0)).await.expect("push");
            assert_eq!(c.recv().await.expect("pull").len(), 1 << 20);
        }));
    }
    for j in jobs {
        j.await.expect("connection task");
    }
    let rss2 = status_kib("VmRSS:");
    // Pool buffers (shm: zero copy), one connection after the other: connections of one
    // process pair share one pool, so each reuses the pages the one before touched.
    let mut rss3 = rss2;
    if provider == "shm" {
        for c in &conns {
            let mut b = c.alloc(1 << 20).expect("pool alloc");
            b.fill(7);
            c.send(b.freeze()).await.expect("pool push");
            assert_eq!(c.recv().await.expect("pull").len(), 1 << 20);
        }
        rss3 = status_kib("VmRSS:");
    }
    for c in &conns {
        c.close().await;
    }
    drop(conns);
    for t in server.await.expect("server") {
        let _ = t.await;
    }
    println!(
        "footprint {provider}: {n} connections, connect {:.1} ms each; RSS KiB before {rss0}, idle {rss1} (+{} per connection, both ends), after a 1 MiB push+pull each {rss2}, after a 1 MiB pool push on each in turn {rss3} (+{} KiB); memfd mappings {} -> {} ({} -> {} KiB mapped), VmPin {} KiB",
        connect.as_secs_f64() * 1e3 / n as f64,
        rss1.saturating_sub(rss0) / n as u64,
        rss3.saturating_sub(rss2),
        maps0.0,
        maps1.0,
        maps0.1,
        maps1.1,
        status_kib("VmPin:"),
    );
    // One pool per side of the process pair, each mapped by the other end: four mappings
    // in this one process (which is both ends), whatever the connection count.
    // Saturating: the previous provider's pools may be unmapped only after the count before
    // (the last of its buffers dropped late), which made this subtraction overflow.
    let added = pools1.saturating_sub(pools0);
    assert!(
        added <= 4,
        "{n} {provider} connections between two ends added {added} pool mappings; the pair should share one pool per side"
    );
    // Loose bounds: pages are touched lazily on shm and tcp, so an idle connection's
    // resident cost is its slots and bookkeeping, not its 256 MiB pool.
    assert!(
        rss1.saturating_sub(rss0) / (n as u64) < 16 << 10,
        "an idle {provider} connection costs more than 16 MiB resident"
    );
}

/// One test, providers one after the other: the figures are per process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_and_tcp_connection_footprint() {
    footprint("shm").await;
    footprint("tcp").await;
}
