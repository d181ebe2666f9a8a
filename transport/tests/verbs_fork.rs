//! Fork safety: a process forks after registering memory and while transfers are
//! in flight; the child does some work of its own and exits; every transfer of the parent
//! completes bit for bit, including ones from registered memory the parent rewrites after
//! the fork (the classic failure: the parent's write breaks copy-on-write, the parent gets a
//! fresh page, and the device keeps using the old one, now the child's). Runs in the
//! Soft-RoCE VM (`scripts/verbs-test.sh`); elsewhere it says why it skips.
#![cfg(feature = "verbs")]

use std::time::Duration;

use bytes::Bytes;
use ibex_test_support::pattern;
use ibex_transport::{Config, Connection, connect, listen, verbs};

fn skip() -> bool {
    if std::env::var("RXE_VM").is_err() {
        println!("skipped: no RDMA device (run scripts/verbs-test.sh)");
        return true;
    }
    false
}

fn config(var: &str) -> Config {
    let mut c = Config::from_env().expect("IBEX_* environment variables");
    c.rdma_device = std::env::var(var).ok();
    c.eager_threshold = Some(16 << 10);
    c.fragment_size = Some(c.default_fragment_size);
    c.pool_size = 16 << 20;
    c
}

const LEN: usize = 1 << 20;

/// One round: the client sends a registered-pool buffer it fills now and a heap buffer (both
/// rendezvous: the server reads them with RDMA READ); the server checks both and answers with
/// a buffer the client reads into its registered receive memory, which the client checks.
async fn round(client: &Connection, server: &Connection, seed: u8) {
    let mut b = client.alloc(LEN).expect("pool buffer");
    b.copy_from_slice(&pattern(LEN, seed));
    let from_pool = b.freeze();
    let from_heap = Bytes::from(pattern(LEN, seed.wrapping_add(100)));
    let send = async {
        client.send(from_pool).await.expect("send pool buffer");
        client.send(from_heap).await.expect("send heap buffer");
        let reply = client.recv().await.expect("reply");
        assert!(
            reply[..] == pattern(LEN, seed.wrapping_add(200))[..],
            "round {seed}: the reply read into registered memory differs"
        );
    };
    let serve = async {
        let a = server.recv().await.expect("recv pool buffer");
        assert!(
            a[..] == pattern(LEN, seed)[..],
            "round {seed}: the pool buffer written after registration differs"
        );
        let h = server.recv().await.expect("recv heap buffer");
        assert!(
            h[..] == pattern(LEN, seed.wrapping_add(100))[..],
            "round {seed}: the heap buffer differs"
        );
        server
            .send(Bytes::from(pattern(LEN, seed.wrapping_add(200))))
            .await
            .expect("reply");
    };
    tokio::join!(send, serve);
}

/// What the child does: work of its own (allocating, filling and summing memory, as a data
/// loader would), and, where the kernel gives the child its own copy of registered pages,
/// scribbling over its copy of the parent's registered pool. No verbs call, no runtime, no
/// destructors: it leaves with `_exit`.
fn child(pool_base: *mut u8, pool_len: usize, scribble: bool) -> ! {
    let mut v = vec![0u8; 8 << 20];
    for (i, x) in v.iter_mut().enumerate() {
        *x = i as u8;
    }
    let sum: u64 = v.iter().map(|&x| x as u64).sum();
    if scribble {
        // SAFETY: the child's copy of the parent's pool mapping; nobody else runs in the child.
        unsafe { std::ptr::write_bytes(pool_base, 0xEE, pool_len) };
    }
    std::thread::sleep(Duration::from_millis(50));
    let ok = sum == (8u64 << 20) / 256 * (255 * 256 / 2);
    // SAFETY: ends the child without running the parent's destructors or atexit handlers.
    unsafe { libc::_exit(if ok { 0 } else { 3 }) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_while_transfers_are_in_flight_corrupts_nothing() {
    if skip() {
        return;
    }
    let at = format!(
        "verbs://{}",
        std::env::var("IBEX_TEST_LISTEN_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into())
    );
    let l = listen(&at, config("IBEX_TEST_SERVER_DEV"))
        .await
        .expect("listen");
    let addr = l.local_uri();
    let (s, c) = tokio::join!(l.accept(), connect(&addr, config("IBEX_TEST_CLIENT_DEV")));
    let (server, client) = (s.expect("accept"), c.expect("connect"));
    let status = verbs::fork_status();
    println!("verbs_fork: fork safety: {status}");

    // Register everything first: the pool, cached exposures, receive memory.
    round(&client, &server, 1).await;
    let pool = client.pool().expect("pool");

    // Transfers in flight while the process forks.
    let (c2, s2) = (client.clone(), server.clone());
    let inflight = tokio::spawn(async move {
        for seed in 2..12u8 {
            round(&c2, &s2, seed).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (base, len) = (pool.base() as *mut u8, pool.size());
    // Where ibv_fork_init marked registered ranges MADV_DONTFORK, the child has no copy of
    // them: it must not touch them (docs/verbs.md, "Fork").
    let scribble = status.starts_with("unneeded");
    // SAFETY: the child only allocates (glibc's malloc is fork-safe), computes, writes its own
    // copy of memory and `_exit`s; it touches no lock another thread of the parent held.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        child(base, len, scribble);
    }
    inflight.await.expect("transfers in flight across the fork");
    // After the fork, the parent rewrites registered memory and sends it again.
    for seed in 12..20u8 {
        round(&client, &server, seed).await;
    }
    let mut st = 0;
    // SAFETY: waits for our own child; `st` is ours.
    let r = unsafe { libc::waitpid(pid, &mut st, 0) };
    assert_eq!(r, pid);
    assert!(
        libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0,
        "the child failed (status {st:#x})"
    );
}
