//! `ibex demo`: the whole job on one machine. It writes a cluster spec with free ports into
//! a fresh directory, starts every PS and worker as its own `ibex launch` process, follows
//! worker 0's progress, shuts the PS down with SIGTERM, and prints the results.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ibex_worker::{ClusterSpec, TransportKind};

use crate::progress::Progress;
use crate::train::{Report, TrainArgs};

/// Test accuracy the demo must reach; below it `ibex demo` exits non-zero.
pub const ACCURACY_BAR: f32 = 0.90;

/// `ibex demo` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// shm | tcp | verbs | grpc (grpc = stock tonic over TCP, the baseline).
    #[arg(long, default_value = "shm")]
    pub transport: TransportKind,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Parameter-server processes (variables are spread across them).
    #[arg(long, default_value_t = 2)]
    pub ps: usize,
    /// Each PS checkpoints every this many steps (0 = only on shutdown).
    #[arg(long, default_value_t = 100)]
    pub checkpoint_every: u64,
    /// Copy worker 0's JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Keep the job directory (spec, logs, checkpoints) instead of deleting it.
    #[arg(long)]
    pub keep: bool,
    /// Training flags shared with `ibex launch` and `ibex train`.
    #[command(flatten)]
    pub train: TrainArgs,
}

/// Children that are killed if the demo ends early, so an error never leaves orphans.
struct Procs {
    list: Vec<(String, Child)>,
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c) in &mut self.list {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Sends SIGTERM so the PS checkpoints and shuts down gracefully.
fn terminate(c: &Child) {
    let Ok(pid) = libc::pid_t::try_from(c.id()) else {
        return;
    };
    // SAFETY: kill(2) on a child we spawned and have not reaped yet, so the pid is ours.
    unsafe {
        libc::kill(pid, libc::SIGTERM);
    }
}

/// The last lines of a log, for error messages.
pub fn tail(path: &Path, lines: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// `count` distinct local ports that were free a moment ago.
pub fn free_ports(count: usize) -> Result<Vec<u16>, String> {
    ibex_worker::free_ports("127.0.0.1", count)
        .map_err(|e| format!("cannot find free local ports: {e}"))
}

/// A fresh job directory under the system temp dir.
pub fn job_dir(tag: &str) -> Result<PathBuf, String> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("ibex-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// Refuses verbs early when this machine has no RDMA device, instead of failing in a child.
pub fn check_transport(t: TransportKind) -> Result<(), String> {
    if t != TransportKind::Verbs {
        return Ok(());
    }
    let devices = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.count())
        .unwrap_or(0);
    if devices == 0 {
        return Err("--transport verbs needs an RDMA device (InfiniBand/RoCE) and Ibex built with its verbs \
                    provider; /sys/class/infiniband lists none here. Use --transport shm (same host) or tcp."
            .into());
    }
    Ok(())
}

/// Runs the demo; returns worker 0's report (the caller checks the accuracy bar).
pub fn run(args: &DemoArgs) -> Result<Report, String> {
    check_transport(args.transport)?;
    crate::gpu::ensure(args.train.device)?;
    if args.ps == 0 || args.workers == 0 {
        return Err("--ps and --workers must be at least 1".into());
    }
    let dir = job_dir("demo")?;
    let result = run_in(args, &dir);
    if result.is_ok() && !args.keep {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("job directory (spec, logs, checkpoints): {}", dir.display());
    }
    result
}

fn run_in(args: &DemoArgs, dir: &Path) -> Result<Report, String> {
    let ports = free_ports(args.ps + args.workers)?;
    let addr = |p: &u16| format!("127.0.0.1:{p}");
    let spec = ClusterSpec::new(
        ports[..args.ps].iter().map(addr).collect(),
        ports[args.ps..].iter().map(addr).collect(),
        args.transport,
    )
    .map_err(|e| e.to_string())?;
    let spec_path = dir.join("cluster.toml");
    std::fs::write(&spec_path, spec.to_toml())
        .map_err(|e| format!("cannot write {}: {e}", spec_path.display()))?;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the ibex binary: {e}"))?;
    let launch = |job: &str, index: usize| {
        let mut c = Command::new(&exe);
        c.arg("launch").arg("--spec").arg(&spec_path).args([
            "--job",
            job,
            "--index",
            &index.to_string(),
        ]);
        // shm sockets of this job live in its own directory, away from other jobs' ports.
        c.env("IBEX_SHM_DIR", dir).stdin(Stdio::null());
        c
    };
    let log = |name: &str| -> Result<Stdio, String> {
        let p = dir.join(format!("{name}.log"));
        std::fs::File::create(&p)
            .map(Stdio::from)
            .map_err(|e| format!("cannot create {}: {e}", p.display()))
    };
    let both = |name: &str| -> Result<(Stdio, Stdio), String> {
        let p = dir.join(format!("{name}.log"));
        let f =
            std::fs::File::create(&p).map_err(|e| format!("cannot create {}: {e}", p.display()))?;
        let f2 = f
            .try_clone()
            .map_err(|e| format!("cannot open {}: {e}", p.display()))?;
        Ok((Stdio::from(f), Stdio::from(f2)))
    };

    println!(
        "ibex demo: {} PS + {} workers on {}, MLP {} steps, batch {} ({} per worker)",
        args.ps,
        args.workers,
        args.transport,
        args.train.steps,
        args.train.batch,
        args.train.batch / args.workers.max(1)
    );
    let mut ps = Procs { list: Vec::new() };
    for i in 0..args.ps {
        let (out, err) = both(&format!("ps-{i}"))?;
        let mut c = launch("ps", i);
        c.args([
            "--mode",
            "sync",
            "--checkpoint-every",
            &args.checkpoint_every.to_string(),
        ]);
        c.arg("--checkpoint-dir").arg(dir.join(format!("ckpt-{i}")));
        let child = c
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start PS {i}: {e}"))?;
        ps.list.push((format!("ps-{i}"), child));
    }
    let mut workers = Procs { list: Vec::new() };
    let mut lines = None;
    for i in 0..args.workers {
        let mut c = launch("worker", i);
        c.args(args.train.to_args())
            .arg("--report")
            .arg(dir.join(format!("report-{i}.json")));
        if i == 0 {
            c.arg("--ticks")
                .stdout(Stdio::piped())
                .stderr(log("worker-0")?);
        } else {
            let (out, err) = both(&format!("worker-{i}"))?;
            c.stdout(out).stderr(err);
        }
        let mut child = c
            .spawn()
            .map_err(|e| format!("cannot start worker {i}: {e}"))?;
        if let Some(out) = child.stdout.take() {
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                for l in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send(l).is_err() {
                        break;
                    }
                }
            });
            lines = Some(rx);
        }
        workers.list.push((format!("worker-{i}"), child));
    }

    let mut progress = Progress::new(args.train.steps);
    let mut pending: Vec<bool> = vec![true; workers.list.len()];
    while pending.iter().any(|&p| p) {
        if let Some(rx) = &lines {
            while let Ok(l) = rx.try_recv() {
                show(&mut progress, &l);
            }
        }
        for (i, (name, c)) in workers.list.iter_mut().enumerate() {
            if !pending[i] {
                continue;
            }
            if let Some(status) = c
                .try_wait()
                .map_err(|e| format!("cannot wait for {name}: {e}"))?
            {
                pending[i] = false;
                if !status.success() {
                    progress.finish();
                    return Err(format!(
                        "{name} failed ({status}):\n{}",
                        tail(&dir.join(format!("{name}.log")), 15)
                    ));
                }
            }
        }
        for (name, c) in &mut ps.list {
            if let Some(status) = c
                .try_wait()
                .map_err(|e| format!("cannot wait for {name}: {e}"))?
            {
                progress.finish();
                return Err(format!(
                    "{name} exited early ({status}):\n{}",
                    tail(&dir.join(format!("{name}.log")), 15)
                ));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(rx) = &lines {
        while let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            show(&mut progress, &l);
        }
    }
    progress.finish();
    shutdown_ps(&mut ps, dir)?;

    let report = Report::read(&dir.join("report-0.json"))?;
    if let Some(p) = &args.report {
        report.write(p)?;
    }
    println!(
        "final test accuracy: {:.2}% ({} test examples)",
        report.test_accuracy * 100.0,
        args.train.test_size
    );
    println!("final training loss: {:.5}", report.train_loss);
    println!("steps/s (worker 0): {:.1}", report.steps_per_sec);
    println!("communication profile (worker 0):\n{}", report.comm_profile);
    Ok(report)
}

fn show(progress: &mut Progress, line: &str) {
    if let Some(done) = line
        .strip_prefix("tick ")
        .and_then(|s| s.parse::<u64>().ok())
    {
        progress.tick(done);
        return;
    }
    let mut it = line.split_whitespace();
    if let (Some("step"), Some(step), Some("loss"), Some(loss)) =
        (it.next(), it.next(), it.next(), it.next())
        && let (Ok(step), Ok(loss)) = (step.parse::<u64>(), loss.parse::<f32>())
    {
        progress.line(&format!("  step {step:>5}  loss {loss:.5}"));
        progress.set_loss(loss);
        return;
    }
    progress.line(&format!("  {line}"));
}

/// SIGTERM every PS (each checkpoints and exits), then waits up to 15 s.
fn shutdown_ps(ps: &mut Procs, dir: &Path) -> Result<(), String> {
    for (_, c) in &ps.list {
        terminate(c);
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    for (name, c) in &mut ps.list {
        loop {
            match c.try_wait() {
                Ok(Some(s)) if s.success() => break,
                Ok(Some(s)) => {
                    return Err(format!(
                        "{name} failed at shutdown ({s}):\n{}",
                        tail(&dir.join(format!("{name}.log")), 15)
                    ));
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => return Err(format!("{name} did not shut down within 15 s of SIGTERM")),
                Err(e) => return Err(format!("cannot wait for {name}: {e}")),
            }
        }
    }
    Ok(())
}
