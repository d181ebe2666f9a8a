//! End-to-end tests of the `ibex` binary: the multi-process demo against the single-process
//! reference, the stock-gRPC baseline, a PS killed with SIGKILL and restored from its
//! checkpoint, and the launcher's errors for bad task descriptions.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ibex_test_support::{Launch, Server, free_port};

mod common;

use common::{Dir, Kids};

const IBEX: &str = env!("CARGO_BIN_EXE_ibex");

fn ibex(args: &[&str], dir: &Path) -> Output {
    Command::new(IBEX)
        .args(args)
        .env("IBEX_SHM_DIR", dir)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn report(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The demo's two worker processes reach the accuracy bar and end within the stated
/// tolerance (`MATCH_TOLERANCE`, 1e-4 relative) of one process computing the full batch.
#[test]
fn demo_on_shm_reaches_the_bar_and_matches_the_reference() {
    let dir = Dir::new("shm");
    let rep = dir.0.join("demo.json");
    let rep_s = rep.to_str().unwrap();
    let o = ibex(
        &[
            "demo",
            "--steps",
            "150",
            "--log-every",
            "50",
            "--report",
            rep_s,
        ],
        &dir.0,
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for want in [
        "step     0",
        "final test accuracy",
        "steps/s",
        "communication profile",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
    let r = report(&rep);
    assert_eq!(r["steps"], 150);
    assert_eq!(r["workers"], 2);
    assert!(r["test_accuracy"].as_f64().unwrap() >= 0.9, "{out}");
    // The same math in one process from the same initial weights (the PS chose them).
    let o = ibex(
        &[
            "train",
            "--reference",
            "--steps",
            "150",
            "--log-every",
            "50",
            "--init-from",
            rep_s,
            "--compare",
            rep_s,
        ],
        &dir.0,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("max relative weight difference"),
        "{}",
        text(&o)
    );
}

/// `--transport grpc` runs the same job over stock tonic (HTTP/2 over TCP); with
/// `--overlap`, each step pushes layer by layer and then pulls.
#[test]
fn demo_over_stock_grpc_with_overlapped_pushes() {
    let dir = Dir::new("grpc");
    let rep = dir.0.join("demo.json");
    let o = ibex(
        &[
            "demo",
            "--transport",
            "grpc",
            "--overlap",
            "--steps",
            "150",
            "--report",
            rep.to_str().unwrap(),
        ],
        &dir.0,
    );
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&rep);
    assert_eq!(r["steps"], 150);
    assert!(r["test_accuracy"].as_f64().unwrap() >= 0.9);
    let profile = r["comm_profile"].as_str().unwrap();
    assert!(
        profile.contains("Push ") && !profile.contains("PushPull"),
        "{profile}"
    );
}

/// `--transport tcp`, one PS and one worker: the smallest distributed shape still trains.
#[test]
fn demo_over_ibex_tcp_with_one_ps() {
    let dir = Dir::new("tcp");
    let o = ibex(
        &[
            "demo",
            "--transport",
            "tcp",
            "--ps",
            "1",
            "--workers",
            "1",
            "--steps",
            "120",
        ],
        &dir.0,
    );
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("final test accuracy"));
}

#[test]
fn verbs_without_a_device_is_a_clear_error() {
    if std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.count())
        .unwrap_or(0)
        > 0
    {
        eprintln!("skipped: this machine has an RDMA device");
        return;
    }
    let dir = Dir::new("verbs");
    let o = ibex(&["demo", "--transport", "verbs"], &dir.0);
    assert!(!o.status.success());
    assert!(text(&o).contains("needs an RDMA device"), "{}", text(&o));
}

#[test]
fn launcher_reports_bad_task_descriptions() {
    let dir = Dir::new("launch");
    let spec = dir.0.join("cluster.toml");
    std::fs::write(
        &spec,
        "[cluster]\nps = [\"127.0.0.1:1\"]\nworkers = [\"127.0.0.1:2\"]\n",
    )
    .unwrap();
    let s = spec.to_str().unwrap();
    let o = ibex(
        &["launch", "--spec", s, "--job", "worker", "--index", "3"],
        &dir.0,
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("out of range"), "{}", text(&o));
    let o = ibex(&["launch", "--spec", s, "--index", "0"], &dir.0);
    assert!(text(&o).contains("--spec needs --job"), "{}", text(&o));
    std::fs::write(
        &spec,
        "[cluster]\nps = [\"nohost\"]\nworkers = [\"127.0.0.1:2\"]\n",
    )
    .unwrap();
    let o = ibex(
        &["launch", "--spec", s, "--job", "ps", "--index", "0"],
        &dir.0,
    );
    assert!(text(&o).contains("\"nohost\""), "{}", text(&o));

    let o = Command::new(IBEX)
        .args(["launch"])
        .env_remove("SLURM_PROCID")
        .env(
            "TF_CONFIG",
            r#"{"cluster":{"ps":["a:1"],"worker":["b:2"]},"task":{"type":"worker","index":5}}"#,
        )
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o).contains("TF_CONFIG") && text(&o).contains("out of range"),
        "{}",
        text(&o)
    );
    let o = Command::new(IBEX)
        .args(["launch"])
        .env_remove("TF_CONFIG")
        .envs([
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "3"),
            ("SLURM_JOB_NODELIST", "node[01-"),
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("unmatched '['"), "{}", text(&o));
}

/// A PS killed with SIGKILL mid-training and restarted with `--restore`: the workers
/// reconnect, worker 0 brings every PS back to the newest common checkpoint, and training
/// resumes there. The data order depends only on the step, so with no step lost or applied
/// twice the result equals an uninterrupted run: the reference, within the tolerance.
#[test]
fn ps_killed_mid_training_resumes_from_its_checkpoint() {
    let dir = Dir::new("kill");
    let d = &dir.0;
    let ports: Vec<u16> = (0..4).map(|_| free_port()).collect();
    let spec = d.join("cluster.toml");
    std::fs::write(
        &spec,
        format!(
            "[cluster]\nps = [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]\nworkers = [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]\ntransport = \"shm\"\n",
            ports[0], ports[1], ports[2], ports[3]
        ),
    )
    .unwrap();
    let steps = "150";
    let ps = |i: usize, restore: bool| -> Server {
        let mut c = Launch::new(IBEX);
        c.args([
            "launch",
            "--spec",
            spec.to_str().unwrap(),
            "--job",
            "ps",
            "--index",
            &i.to_string(),
        ])
        .args(["--checkpoint-every", "20", "--sync-timeout-secs", "5"])
        .arg("--checkpoint-dir")
        .arg(d.join(format!("ckpt-{i}")))
        .env("IBEX_SHM_DIR", d)
        // Where an shm PS of this spec listens (`ClusterSpec::ps_uri`).
        .ready_on(&format!(
            "shm://{}",
            d.join(format!("ibex-{}.sock", ports[i])).display()
        ));
        if restore {
            c.arg("--restore");
        }
        c.spawn().unwrap()
    };
    let worker = |i: usize| -> Child {
        Command::new(IBEX)
            .args([
                "launch",
                "--spec",
                spec.to_str().unwrap(),
                "--job",
                "worker",
                "--index",
                &i.to_string(),
            ])
            .args(["--steps", steps, "--log-every", "10"])
            .arg("--report")
            .arg(d.join(format!("report-{i}.json")))
            .env("IBEX_SHM_DIR", d)
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                std::fs::File::create(d.join(format!("worker-{i}.log"))).unwrap(),
            ))
            .spawn()
            .unwrap()
    };
    let mut ps0 = ps(0, false);
    let _ps1 = ps(1, false);
    let mut kids = Kids(vec![worker(0), worker(1)]);
    let (tx, rx) = mpsc::channel();
    let out = kids.0[0].stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    // Kill PS 0 once training is past a few checkpoints.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let l = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("worker 0 went quiet");
        let step = l
            .strip_prefix("step ")
            .and_then(|r| r.split_whitespace().next())
            .and_then(|s| s.parse::<u64>().ok());
        if step.is_some_and(|s| s >= 90) {
            break;
        }
    }
    ps0.kill().unwrap(); // SIGKILL: no shutdown checkpoint
    std::thread::sleep(Duration::from_millis(300));
    let _restored = ps(0, true);

    let mut lines = Vec::new();
    for i in [0, 1] {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            while let Ok(l) = rx.try_recv() {
                lines.push(l);
            }
            if let Some(s) = kids.0[i].try_wait().unwrap() {
                let log =
                    std::fs::read_to_string(d.join(format!("worker-{i}.log"))).unwrap_or_default();
                assert!(s.success(), "worker {i} failed: {log}");
                break;
            }
            assert!(Instant::now() < deadline, "worker {i} did not finish");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // Worker 0 has exited, but the reader thread may not have forwarded its last lines
    // yet: it drops the sender at the pipe's end, so drain until then. The cap guards
    // against a hang only.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(l) => lines.push(l),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("worker 0's output did not end within 30 s of its exit")
            }
        }
    }
    let r = report(&d.join("report-0.json"));
    assert_eq!(r["steps"], 150, "final step count");
    assert!(
        r["recoveries"].as_u64().unwrap() >= 1,
        "worker 0 never saw the PS die"
    );
    assert!(
        lines.iter().any(|l| l.starts_with("recovered at step")),
        "{lines:?}"
    );
    assert!(r["test_accuracy"].as_f64().unwrap() >= 0.9);
    let r1 = report(&d.join("report-1.json"));
    assert_eq!(r1["steps"], 150);
    // Same weights as an uninterrupted single-process run from the same start.
    let rep = d.join("report-0.json");
    let rep = rep.to_str().unwrap();
    let o = ibex(
        &[
            "train",
            "--reference",
            "--steps",
            steps,
            "--init-from",
            rep,
            "--compare",
            rep,
        ],
        d,
    );
    assert!(o.status.success(), "{}", text(&o));
}

/// Too few steps to learn: the demo says so and exits non-zero.
#[test]
fn demo_below_the_accuracy_bar_fails() {
    let dir = Dir::new("short");
    let o = ibex(&["demo", "--steps", "2", "--lr", "0.001"], &dir.0);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("below the 90% bar"), "{}", text(&o));
}

/// Two consecutive free ports (Slurm tasks listen on IBEX_BASE_PORT + rank).
fn two_consecutive_ports() -> u16 {
    for _ in 0..50 {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two consecutive free ports");
}

/// A job described by the scheduler instead of a spec file: the PS from a Slurm step's
/// environment, the worker from TF_CONFIG, both over Ibex tcp (IBEX_TRANSPORT).
#[test]
fn launch_from_slurm_and_tf_config() {
    let dir = Dir::new("sched");
    let p = two_consecutive_ports();
    let _ps = Launch::new(IBEX)
        .args(["launch", "--checkpoint-dir"])
        .arg(dir.0.join("ckpt"))
        .env_remove("TF_CONFIG")
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_JOB_NODELIST", "127.0.0.1")
        .env("IBEX_NUM_PS", "1")
        .env("IBEX_BASE_PORT", p.to_string())
        .env("IBEX_TRANSPORT", "tcp")
        .ready_on(&format!("tcp://127.0.0.1:{p}"))
        .spawn()
        .unwrap();
    let tf = format!(
        r#"{{"cluster":{{"ps":["127.0.0.1:{p}"],"worker":["127.0.0.1:{}"]}},"task":{{"type":"worker","index":0}}}}"#,
        p + 1
    );
    let rep = dir.0.join("w.json");
    let o = Command::new(IBEX)
        .args([
            "launch",
            "--steps",
            "120",
            "--log-every",
            "1000",
            "--report",
        ])
        .arg(&rep)
        .env_remove("SLURM_PROCID")
        .env("TF_CONFIG", tf)
        .env("IBEX_TRANSPORT", "tcp")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let r = report(&rep);
    assert_eq!(
        (r["steps"].as_u64(), r["workers"].as_u64()),
        (Some(120), Some(1))
    );
    assert!(r["test_accuracy"].as_f64().unwrap() >= 0.9);
    assert!(
        r["comm_profile"].as_str().unwrap().contains("tcp"),
        "{}",
        r["comm_profile"]
    );
}
