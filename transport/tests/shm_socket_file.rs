//! No stale shm socket files: a listener's file goes when the listener does, when its
//! process exits without running destructors (`std::process::exit`), and a file left by a
//! killed process does not stop the next listener on the same path.
//!
//! The listening process is this test binary re-executed (`IBEX_TEST_SOCKET` set), so it
//! can exit or be killed for real.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use ibex_transport::{connect, listen};

mod conn_util;
use conn_util::{fixed_threshold, init_tracing};

const SOCKET: &str = "IBEX_TEST_SOCKET";
const HOW: &str = "IBEX_TEST_EXIT";
const GUARD: Duration = Duration::from_secs(60);

fn path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ibex-test-{}-{tag}.sock", std::process::id()))
}

/// The child: listens on `$IBEX_TEST_SOCKET`, says so, then exits with the listener still
/// alive (`exit`) or waits to be killed (`hang`).
#[test]
#[ignore = "helper: the listening process the other tests start"]
fn listening_child() {
    let at = std::env::var(SOCKET).expect("run by a test of this file");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let l = rt.block_on(listen(&format!("shm://{at}"), fixed_threshold(4096)));
    let _l = l.expect("listen");
    println!("child-listening");
    if std::env::var(HOW).as_deref() == Ok("exit") {
        std::process::exit(0);
    }
    std::thread::sleep(GUARD);
}

/// Starts the child on `p` and waits until it listens.
fn start_child(p: &PathBuf, how: &str) -> std::process::Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "listening_child", "--nocapture"])
        .env(SOCKET, p)
        .env(HOW, how)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let listening = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.contains("child-listening"));
    assert!(listening, "the child did not start listening");
    child
}

#[test]
fn a_process_that_exits_with_its_listener_alive_leaves_no_socket_file() {
    let p = path("exit");
    let mut child = start_child(&p, "exit");
    assert!(child.wait().unwrap().success());
    assert!(
        !p.exists(),
        "std::process::exit left the socket file {} behind",
        p.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_listeners_socket_file_does_not_stop_the_next_listener() {
    init_tracing();
    let p = path("killed");
    let mut child = start_child(&p, "hang");
    assert!(p.exists(), "the child's socket file");
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        p.exists(),
        "SIGKILL runs no clean-up: the file is stale now"
    );

    let uri = format!("shm://{}", p.display());
    let l = listen(&uri, fixed_threshold(4096))
        .await
        .expect("a stale socket file is replaced");
    let (server, client) = tokio::join!(
        tokio::time::timeout(GUARD, l.accept()),
        connect(&uri, fixed_threshold(4096))
    );
    let (server, client) = (server.expect("hang guard").unwrap(), client.unwrap());
    client.send(Bytes::from_static(b"hello")).await.unwrap();
    assert_eq!(&server.recv().await.unwrap()[..], b"hello");
    drop(l);
    assert!(
        !p.exists(),
        "the new listener removes its file when dropped"
    );
}
