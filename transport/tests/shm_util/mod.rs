//! Helpers shared by the shm integration tests.
#![allow(dead_code)]

use std::future::poll_fn;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use bytes::Bytes;
use ibex_transport::link::{Link, LinkEvent, RecvBuf};
use ibex_transport::shm::{self, ShmLink};
use ibex_transport::{Config, Error};

/// A socket path unique to this process and test.
pub fn sock_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ibex-shm-{}-{name}.sock", std::process::id()))
}

/// A small configuration so tests stay light.
pub fn small_config() -> Config {
    Config {
        slot_size: 4096,
        credits: 4,
        pool_size: 4 << 20,
        // The environment's settings, so that a child run with `IBEX_SHM_FORCE_BOUNCE=1`
        // reads through the bounce area.
        ..Config::from_env().expect("IBEX_* environment variables")
    }
}

/// Two linked ends in this process: (accepted, connected).
pub async fn pair(name: &str, a: &Config, b: &Config) -> (ShmLink, ShmLink) {
    let path = sock_path(name);
    let listener = shm::listen(&path, a).await.expect("listen");
    let (x, y) = tokio::join!(listener.accept(), shm::connect(&path, b));
    (x.expect("accept"), y.expect("connect"))
}

pub async fn send(link: &mut ShmLink, frame: &[u8]) -> Result<(), Error> {
    poll_fn(|cx| link.poll_send(cx, frame)).await
}

pub async fn event(link: &mut ShmLink) -> Result<LinkEvent, Error> {
    poll_fn(|cx| link.poll_event(cx)).await
}

pub async fn frame(link: &mut ShmLink) -> Bytes {
    match event(link).await.expect("event") {
        LinkEvent::Frame(f) => f,
        other => panic!("expected a frame, got {other:?}"),
    }
}

#[allow(unused_imports)] // not every test binary that shares this module sends patterns
pub use ibex_test_support::pattern;

/// Reads `total` bytes of `desc` with `frag`-byte reads, `inflight` at a time, the way the
/// driver does. Frames arriving meanwhile are an error.
pub async fn read_all(
    reader: &mut ShmLink,
    desc: &[u8],
    offset: u64,
    total: usize,
    frag: usize,
    inflight: usize,
) -> Result<RecvBuf, Error> {
    let mut dst = reader.alloc_recv(total)?;
    let base = dst.as_mut_ptr();
    let (mut next, mut outstanding, mut done) = (0usize, 0usize, 0usize);
    let mut lens = std::collections::HashMap::new();
    let mut failure = None;
    while done < total && failure.is_none() {
        while outstanding < inflight && next < total {
            let n = frag.min(total - next);
            // SAFETY: base+next..+n lies in `dst`, which is kept alive (leaked on failure)
            // until every posted read has completed.
            if let Err(e) = unsafe {
                reader.post_read(next as u64, desc, offset + next as u64, base.add(next), n)
            } {
                failure = Some(e);
                break;
            }
            lens.insert(next as u64, n);
            next += n;
            outstanding += 1;
        }
        if failure.is_some() {
            break;
        }
        match event(reader).await {
            Ok(LinkEvent::ReadDone { id, result }) => {
                outstanding -= 1;
                done += lens.remove(&id).expect("completion for a read we posted");
                if let Err(e) = result {
                    failure = Some(e);
                }
            }
            Ok(LinkEvent::Frame(f)) => {
                panic!("unexpected frame of {} bytes during a read", f.len())
            }
            Err(e) => failure = Some(e),
        }
    }
    match failure {
        None => Ok(dst),
        Some(e) => {
            if outstanding > 0 {
                // The link may still write into it: never free it.
                std::mem::forget(dst);
            }
            Err(e)
        }
    }
}

/// Runs the `#[ignore]`d test `name` of this test binary in a child process with `envs`.
pub fn child(name: &str, envs: &[(&str, &str)]) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("current_exe"));
    c.args([
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]);
    for (k, v) in envs {
        c.env(k, v);
    }
    c.stdin(Stdio::null());
    c
}

/// Runs a child test to completion and fails with its output if it failed.
pub fn run_child(name: &str, envs: &[(&str, &str)]) {
    let out = child(name, envs).output().expect("spawning the child test");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child {name} failed:\n{text}");
    assert!(
        text.contains("1 passed"),
        "child {name} did not run:\n{text}"
    );
}

/// Descriptors open in this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Mappings of ibex memfds in this process.
pub fn memfd_maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().filter(|l| l.contains("memfd:ibex-shm")).count())
        .unwrap_or(0)
}

/// The /proc/self/maps line of the mapping containing `addr`.
pub fn mapping_of(addr: usize) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .find(|l| {
            let range = l.split_whitespace().next().unwrap_or("");
            let (lo, hi) = range.split_once('-').unwrap_or(("0", "0"));
            let lo = usize::from_str_radix(lo, 16).unwrap_or(0);
            let hi = usize::from_str_radix(hi, 16).unwrap_or(0);
            lo <= addr && addr < hi
        })
        .map(String::from)
}
