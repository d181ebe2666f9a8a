//! Peers killed mid-training with SIGKILL: a worker (the survivor must hear of it within
//! the sync timeout and a few seconds, and no PS may be rolled back), and a PS that is not
//! restarted (every worker must report it within seconds and then fail, not hang).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use common::{Dir, Kids};

const IBEX: &str = env!("CARGO_BIN_EXE_ibex");

/// Two PS (each with a metrics port) and two workers on shm, sync timeout 10 s.
struct Job {
    dir: Dir,
    spec: PathBuf,
    metrics: Vec<u16>,
    kids: Kids,
    /// Worker 0's stdout lines.
    lines: mpsc::Receiver<String>,
    steps: u64,
    ps_flags: Vec<String>,
}

impl Job {
    fn start(tag: &str, steps: u64, worker_flags: &[&str], ps_flags: &[&str]) -> Job {
        let dir = Dir::new(tag);
        let p: Vec<u16> = (0..6).map(|_| ibex_test_support::free_port()).collect();
        let spec = dir.0.join("cluster.toml");
        std::fs::write(
            &spec,
            format!(
                "[cluster]\nps = [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]\nworkers = [\"127.0.0.1:{}\", \"127.0.0.1:{}\"]\ntransport = \"shm\"\nsync_timeout_secs = 10\n",
                p[0], p[1], p[2], p[3]
            ),
        )
        .unwrap();
        let mut job = Job {
            dir,
            spec,
            metrics: vec![p[4], p[5]],
            kids: Kids(Vec::new()),
            lines: mpsc::channel().1,
            steps,
            ps_flags: ps_flags.iter().map(|f| f.to_string()).collect(),
        };
        for i in 0..2 {
            let c = job.ps(i);
            job.kids.0.push(c);
        }
        for i in 0..2 {
            let c = job.worker(i, worker_flags);
            job.kids.0.push(c);
        }
        let (tx, rx) = mpsc::channel();
        let out = job.kids.0[2].stdout.take().unwrap();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        job.lines = rx;
        job
    }

    fn launch(&self, job: &str, i: usize) -> Command {
        let mut c = Command::new(IBEX);
        c.args(["launch", "--spec"])
            .arg(&self.spec)
            .args(["--job", job, "--index", &i.to_string()])
            .env("IBEX_SHM_DIR", &self.dir.0)
            .stderr(Stdio::from(
                std::fs::File::create(self.log(job, i)).unwrap(),
            ));
        c
    }

    fn log(&self, job: &str, i: usize) -> PathBuf {
        self.dir.0.join(format!("{job}-{i}.log"))
    }

    fn ps(&self, i: usize) -> Child {
        self.launch("ps", i)
            .args(["--checkpoint-every", "20", "--metrics"])
            .arg(format!("127.0.0.1:{}", self.metrics[i]))
            .arg("--checkpoint-dir")
            .arg(self.dir.0.join(format!("ckpt-{i}")))
            .args(&self.ps_flags)
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    }

    fn worker(&self, i: usize, flags: &[&str]) -> Child {
        self.launch("worker", i)
            .args(["--steps", &self.steps.to_string(), "--log-every", "10"])
            .arg("--report")
            .arg(self.dir.0.join(format!("report-{i}.json")))
            .args(flags)
            .stdout(if i == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()
            .unwrap()
    }

    /// Waits until worker 0 has logged step `at` or later; returns the step.
    fn reach(&self, at: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let l = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .expect("worker 0 went quiet before the kill");
            let step = l
                .strip_prefix("step ")
                .and_then(|r| r.split_whitespace().next())
                .and_then(|s| s.parse::<u64>().ok());
            if let Some(s) = step.filter(|&s| s >= at) {
                return s;
            }
        }
    }

    /// PS `i`'s step, from its metrics endpoint.
    fn ps_step(&self, i: usize) -> u64 {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.metrics[i])).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.lines()
            .find(|l| l.starts_with("ibex_ps_step"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no ibex_ps_step in PS {i}'s metrics:\n{body}"))
    }
}

/// Polls `child` until it exits or `limit` passes; returns its status and when it ended.
fn exit_within(child: &mut Child, limit: Duration) -> Option<(ExitStatus, Instant)> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some((s, Instant::now()));
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `log` until it holds `want` or `limit` passes; returns when it did.
fn line_within(log: &Path, want: &str, limit: Duration) -> Option<Instant> {
    let deadline = Instant::now() + limit;
    loop {
        if std::fs::read_to_string(log)
            .unwrap_or_default()
            .contains(want)
        {
            return Some(Instant::now());
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `kill -9` of worker 1 in a 2-worker sync run with a 10 s sync timeout: worker 0 fails
/// within 30 s with an error that names the lost worker, and neither PS is rolled back to
/// a checkpoint (each keeps at least the step worker 0 had reached).
#[test]
fn a_killed_worker_is_named_to_the_survivor_and_no_ps_rolls_back() {
    let mut job = Job::start("worker", 100_000, &[], &[]);
    let reached = job.reach(45);
    job.kids.0[3].kill().unwrap();
    let killed = Instant::now();
    job.kids.0[3].wait().unwrap();
    let (status, ended) = exit_within(&mut job.kids.0[2], Duration::from_secs(30))
        .expect("worker 0 neither failed nor went on within 30 s of the kill");
    let log = std::fs::read_to_string(job.log("worker", 0)).unwrap();
    eprintln!("survivor failed {:?} after the kill: {log}", ended - killed);
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("a worker was lost") && log.contains("workers [1]"),
        "{log}"
    );
    assert!(
        !log.contains("waiting up to"),
        "treated as a PS failure: {log}"
    );
    for i in 0..2 {
        let step = job.ps_step(i);
        assert!(
            step >= reached,
            "PS {i} is at step {step}, below the step {reached} worker 0 had reached: rolled back"
        );
    }
}

/// `kill -9` of PS 0, not restarted: both workers report it within 15 s, and with
/// `--ps-restart-wait-secs 3` fail with an error that says to restart it.
#[test]
fn a_killed_ps_is_reported_within_seconds_and_fails_the_workers() {
    let mut job = Job::start("ps", 100_000, &["--ps-restart-wait-secs", "3"], &[]);
    job.reach(30);
    job.kids.0[0].kill().unwrap();
    let killed = Instant::now();
    job.kids.0[0].wait().unwrap();
    for w in 0..2 {
        let seen = line_within(
            &job.log("worker", w),
            "waiting up to",
            Duration::from_secs(15),
        )
        .unwrap_or_else(|| {
            panic!(
                "worker {w} did not report the PS within 15 s: {}",
                std::fs::read_to_string(job.log("worker", w)).unwrap_or_default()
            )
        });
        eprintln!(
            "worker {w} reported the PS {:?} after the kill",
            seen - killed
        );
    }
    for w in 0..2 {
        let (status, ended) = exit_within(&mut job.kids.0[2 + w], Duration::from_secs(30))
            .unwrap_or_else(|| panic!("worker {w} still runs 30 s after the PS died"));
        let log = std::fs::read_to_string(job.log("worker", w)).unwrap();
        eprintln!("worker {w} exited {:?} after the kill", ended - killed);
        assert!(!status.success(), "{log}");
        assert!(
            log.contains("did not come back") && log.contains("--restore"),
            "{log}"
        );
    }
}

/// With `--on-worker-loss continue` on the PS, the same kill costs the survivor one sync
/// timeout: the missed step completes without worker 1, training goes on, and worker 1,
/// restarted, rejoins; both finish every step and the model still reaches the bar.
#[test]
fn with_on_worker_loss_continue_the_survivor_goes_on_and_the_lost_worker_rejoins() {
    // Enough steps that the survivor, which runs alone at full speed once the missed step
    // is completed, cannot finish them all before the restarted worker is up (a few hundred
    // steps/s here, and a restart on a loaded machine can take seconds).
    const STEPS: u64 = 1500;
    let mut job = Job::start("elastic", STEPS, &[], &["--on-worker-loss", "continue"]);
    let reached = job.reach(45);
    job.kids.0[3].kill().unwrap();
    let killed = Instant::now();
    job.kids.0[3].wait().unwrap();
    job.reach(reached + 20);
    let progress = killed.elapsed();
    eprintln!("survivor 20 steps past the kill {progress:?} after it");
    assert!(progress < Duration::from_secs(30), "{progress:?}");
    for i in 0..2 {
        assert!(job.ps_step(i) >= reached + 20, "PS {i} was rolled back");
    }
    job.kids.0[3] = job.worker(1, &[]);
    for w in 0..2 {
        let (status, _) = exit_within(&mut job.kids.0[2 + w], Duration::from_secs(180))
            .unwrap_or_else(|| panic!("worker {w} did not finish"));
        let log = std::fs::read_to_string(job.log("worker", w)).unwrap();
        assert!(status.success(), "worker {w}: {log}");
        let r: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(job.dir.0.join(format!("report-{w}.json"))).unwrap(),
        )
        .unwrap();
        eprintln!("worker {w}: {} recoveries", r["recoveries"]);
        assert_eq!(r["steps"], STEPS, "worker {w}");
        assert!(
            r["test_accuracy"].as_f64().unwrap() >= 0.9,
            "worker {w}: {r}"
        );
    }
    let ps_log = std::fs::read_to_string(job.log("ps", 0)).unwrap();
    assert!(
        ps_log.contains("completed without workers [1]") && ps_log.contains("worker 1 is back"),
        "{ps_log}"
    );
}
