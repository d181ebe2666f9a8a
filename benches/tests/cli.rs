//! End-to-end: the binary spawns its own server process and reports sane records. Timing is
//! never asserted; only that the calls went through and were counted.

use std::process::Command;
use std::sync::{Mutex, MutexGuard};

/// The ps-step test keeps both cores busy for seconds; the timed tests beside it would then
/// finish no call in their 0.1 s windows. One test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(args: &[&str]) -> Vec<serde_json::Value> {
    let _one = serial();
    let out = Command::new(env!("CARGO_BIN_EXE_ibex-bench"))
        .args(args)
        .args(["--json", "--warmup", "0.02", "--duration", "0.1"])
        .output()
        .expect("run ibex-bench");
    assert!(
        out.status.success(),
        "ibex-bench {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON record"))
        .collect()
}

#[test]
fn latency_over_tonic_ibex_and_raw() {
    for t in ["tonic", "ibex-shm", "ibex-tcp", "raw-shm", "raw-shm-types"] {
        let r = run(&["latency", "--transport", t, "--size", "64"]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0]["transport"], t);
        assert_eq!(r[0]["bytes"], 64);
        assert!(r[0]["calls"].as_u64().unwrap() > 0, "{t}: no calls counted");
        assert!(
            r[0]["server_rss_kib"].as_u64().unwrap() > 0,
            "{t}: server RSS not read"
        );
    }
}

#[test]
fn tensor_descriptor_path_and_ps_throughput() {
    let r = run(&["tensor", "--transport", "ibex-shm", "--size", "1M"]);
    assert_eq!(r[0]["payload"], "registered");
    assert!(r[0]["calls"].as_u64().unwrap() > 0);
    assert_eq!(r[1]["bench"], "memcpy");
    let r = run(&[
        "ps-throughput",
        "--transport",
        "ibex-tcp",
        "--scheme",
        "uniform",
        "--workers",
        "2",
        "--ps",
        "2",
    ]);
    assert_eq!(r[0]["topology"], "2x2");
    assert!(r[0]["calls"].as_u64().unwrap() >= 2);
}

/// The floor of a tonic-compatible layer answers Sink and a tensor with the right sizes (the
/// client checks every answer's size against what it sent).
#[test]
fn types_floor_answers_sink_and_tensor() {
    let r = run(&[
        "ps-throughput",
        "--transport",
        "raw-shm-types",
        "--scheme",
        "uniform",
        "--workers",
        "1",
        "--ps",
        "1",
    ]);
    assert_eq!(r[0]["transport"], "raw-shm-types");
    assert!(r[0]["calls"].as_u64().unwrap() >= 1);
    let r = run(&["tensor", "--transport", "raw-shm-types", "--size", "64K"]);
    assert!(r[0]["calls"].as_u64().unwrap() > 0);
}

#[test]
fn skew_bw_moves_the_paper_payload() {
    let r = run(&["bw", "--transport", "raw-tcp", "--scheme", "skew"]);
    assert_eq!(r[0]["bytes"], 6 * (1 << 20) + 3 * (10 << 10) + 10);
}

#[test]
fn bad_server_address_is_an_error_not_a_hang() {
    let out = Command::new(env!("CARGO_BIN_EXE_ibex-bench"))
        .args([
            "latency",
            "--transport",
            "ibex-tcp",
            "--connect",
            "tcp://127.0.0.1:1",
            "--duration",
            "0.1",
        ])
        .output()
        .expect("run ibex-bench");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("ibex-bench:"));
}

/// Needs the `ibex-ps` binary beside `ibex-bench` (`cargo build -p ibex-ps`; `cargo test
/// --workspace` builds it).
#[test]
fn ps_step_runs_real_ps_processes_and_workers() {
    let _one = serial();
    let out = Command::new(env!("CARGO_BIN_EXE_ibex-bench"))
        .args([
            "ps-step",
            "--model",
            "resnet50",
            "--transport",
            "tcp",
            "--workers",
            "2",
            "--ps",
            "2",
            "--steps",
            "1",
            "--warmup-steps",
            "0",
            "--json",
        ])
        .output()
        .expect("run ibex-bench");
    assert!(
        out.status.success(),
        "ps-step failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).expect("one JSON record");
    assert_eq!(r["bench"], "ps-step");
    assert_eq!(r["transport"], "ibex-tcp");
    assert_eq!(r["topology"], "2x2");
    assert_eq!(r["calls"], 1);
    assert_eq!(r["bytes"], 25_557_032 * 4);
    assert!(r["server_rss_kib"].as_u64().unwrap() > 0, "PS RSS not read");
}

#[test]
fn ps_step_explains_bad_transport_and_missing_ps_binary() {
    let out = Command::new(env!("CARGO_BIN_EXE_ibex-bench"))
        .args(["ps-step", "--transport", "raw-shm"])
        .output()
        .expect("run ibex-bench");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("gRPC only"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ibex-bench"))
        .args(["ps-step"])
        .env("IBEX_PS", "/nonexistent/ibex-ps")
        .output()
        .expect("run ibex-bench");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("IBEX_PS=/nonexistent/ibex-ps is not a file")
    );
}
