//! A listener at its process's descriptor limit: a server child process runs under a low
//! `RLIMIT_NOFILE` while this process holds that many idle Ibex tcp connections to it.
//! An honest peer then makes a fresh connection and one round trip every 250 ms, and
//! each must be answered within a second: the server's cap on connections, derived from
//! the limit, closes the connection idle longest to make room, and the accept loop never
//! runs out of descriptors.
//!
//! The server runs in a child (this same test binary, started again with
//! [`CHILD`] set), so the low limit touches no other test.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ibex_transport::{Config, Connection, Listener, connect, listen};

mod conn_util;
use conn_util::{ANSWERED_WITHIN, fixed_threshold, honest_rounds, init_tracing};

/// Set in the child's environment: it serves instead of testing.
const CHILD: &str = "IBEX_TEST_FD_CAP_SERVER";
/// The child's descriptor limit.
const NOFILE: u64 = 512;
/// Idle connections this process opens: as many as the child may have descriptors.
const IDLE: usize = NOFILE as usize;
/// A hang guard, not a performance assertion.
const GUARD: Duration = Duration::from_secs(60);

/// The server side: listens, says its address on stdout, and echoes every message until
/// its stdin closes (the test ends, or dies).
async fn serve() {
    init_tracing();
    let l: Arc<Listener> = Arc::new(
        listen("tcp://127.0.0.1:0", fixed_threshold(4096))
            .await
            .unwrap(),
    );
    println!("LISTENING {}", l.local_uri());
    let serving = tokio::spawn(async move {
        while let Ok(c) = l.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = c.recv().await {
                    if c.send(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    // The parent holds our stdin; its end is ours.
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {}
    })
    .await;
    serving.abort();
}

/// The child, killed when the test ends however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the server child under [`NOFILE`], as the test `test` with `env` added to its
/// environment, and returns it with its address.
fn spawn_server(test: &str, env: &[(&str, &str)]) -> (Server, String) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .envs(env.iter().copied());
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    // SAFETY: between fork and exec the closure only calls setrlimit, which is
    // async-signal-safe, on a limit value on its own stack.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: NOFILE,
                rlim_max: NOFILE,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = Server(cmd.spawn().expect("starting the server child"));
    let out = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            // The harness may have begun the line with the test's name.
            match line.split_once("LISTENING ") {
                Some((_, at)) => {
                    let _ = tx.send(at.trim().to_string());
                }
                // Its log, with RUST_LOG set.
                None => eprintln!("server: {line}"),
            }
        }
    });
    let at = rx
        .recv_timeout(GUARD)
        .expect("the server child never said where it listens");
    (child, at)
}

/// Descriptors the process `pid` has open.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_at_the_descriptor_limit_leave_room_for_an_honest_peer() {
    if std::env::var_os(CHILD).is_some() {
        return serve().await;
    }
    let (server, at) = spawn_server(
        "idle_connections_at_the_descriptor_limit_leave_room_for_an_honest_peer",
        &[],
    );
    let pid = server.0.id();
    let cfg = Config {
        handshake_timeout: Duration::from_secs(5),
        ..fixed_threshold(4096)
    };

    // As many idle connections as the server has descriptors. Past its cap, newcomers are
    // refused until the first ones have sat idle a second, then take their places.
    let t = Instant::now();
    let (mut idle, mut refused): (Vec<Connection>, usize) = (Vec::new(), 0);
    while idle.len() < IDLE {
        assert!(
            t.elapsed() < GUARD,
            "{} idle connections after {GUARD:?}",
            idle.len()
        );
        match tokio::time::timeout(GUARD, connect(&at, cfg.clone()))
            .await
            .expect("hang guard")
        {
            Ok(c) => idle.push(c),
            Err(_) => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
    let closed = idle.iter().filter(|c| c.is_closed()).count();
    println!(
        "{IDLE} idle connections made in {:?} ({refused} refused on the way, {closed} closed again); server holds {} descriptors of {NOFILE}",
        t.elapsed(),
        open_fds(pid)
    );
    assert!(
        closed > 0,
        "the server made room for newcomers by closing idle connections"
    );
    // Every connection still open is idle past the server's bar by now.
    tokio::time::sleep(Duration::from_millis(1100)).await;

    let times = honest_rounds(&at, &cfg).await;
    let fds = open_fds(pid);
    println!(
        "honest connect + round trip at the server's descriptor limit: max {:?}; server holds {fds} descriptors of {NOFILE}",
        times.iter().max().unwrap()
    );
    assert!(
        (fds as u64) < NOFILE,
        "the server used every descriptor it has"
    );
    // Connections the server closed tell their peer why.
    let closed: Vec<&Connection> = idle.iter().filter(|c| c.is_closed()).collect();
    assert!(!closed.is_empty());
    let why = closed[0].recv().await.unwrap_err().to_string();
    assert!(why.contains("max_connections"), "{why}");
    drop(server);
}

/// With the cap set past what the descriptor limit allows, the server runs out of
/// descriptors. Its accept loop still takes each newcomer off the backlog and closes it
/// (with the spare descriptor it keeps for that), rather than leaving it hanging, and it
/// serves again once descriptors come free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_newcomers_are_closed_and_the_accept_loop_goes_on() {
    if std::env::var_os(CHILD).is_some() {
        return serve().await;
    }
    let (server, at) = spawn_server(
        "out_of_descriptors_newcomers_are_closed_and_the_accept_loop_goes_on",
        &[("IBEX_MAX_CONNECTIONS", "100000")],
    );
    let pid = server.0.id();
    let cfg = Config {
        handshake_timeout: Duration::from_secs(5),
        ..fixed_threshold(4096)
    };
    // Connect until the server has no descriptor left for another.
    let (mut idle, mut failed_in_a_row) = (Vec::new(), 0);
    while failed_in_a_row < 10 {
        assert!(
            idle.len() <= IDLE,
            "the server took more connections than it has descriptors"
        );
        match tokio::time::timeout(GUARD, connect(&at, cfg.clone()))
            .await
            .expect("hang guard")
        {
            Ok(c) => {
                idle.push(c);
                failed_in_a_row = 0;
            }
            Err(_) => failed_in_a_row += 1,
        }
    }
    println!(
        "the server ran out of descriptors at {} connections ({} open of {NOFILE})",
        idle.len(),
        open_fds(pid)
    );
    // A newcomer now is closed at once, not left in the backlog.
    let addr = at.trim_start_matches("tcp://");
    let t = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    use tokio::io::AsyncReadExt;
    let got = tokio::time::timeout(Duration::from_secs(2), s.read(&mut [0u8; 64]))
        .await
        .expect("a newcomer to a server out of descriptors was left hanging");
    assert!(
        matches!(got, Ok(0) | Err(_)),
        "the newcomer got bytes from a server out of descriptors: {got:?}"
    );
    println!("newcomer closed after {:?}", t.elapsed());
    // Descriptors free again: the server serves.
    drop(idle);
    let t = Instant::now();
    loop {
        let r = tokio::time::timeout(ANSWERED_WITHIN, async {
            let c = connect(&at, cfg.clone()).await?;
            c.send(Bytes::from_static(b"back")).await?;
            c.recv().await
        })
        .await;
        if let Ok(Ok(got)) = r {
            assert_eq!(&got[..], b"back");
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the server did not serve again after its descriptors came free: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "served again {:?} after the idle connections closed",
        t.elapsed()
    );
    drop(server);
}
