//! `ps-step`: one synchronous data-parallel training exchange of a real model's variables
//! against the real parameter server, with no compute.
//!
//! N `ibex-ps` processes (the ps-server crate's binary, in sync mode with M workers, SGD on
//! every variable, no checkpoints) and M worker processes (this binary re-run as
//! `ps-worker`), each an [`ibex_worker::Worker`]. A step is what a worker of TensorFlow's
//! parameter-server training does in one iteration (tf_cnn_benchmarks
//! `--variable_update=parameter_server`, `SyncReplicasOptimizer`): read every variable at
//! the start of the step (`Worker::pull_into(names, k, ..)`, which waits until step k-1
//! has been applied by every shard, into the same vectors every step, as a framework keeps
//! its variables), then send every gradient from the framework's slices
//! (`Worker::push(k, ..)`). `--fused` uses Ibex's `push_pull_into` instead (one round trip
//! per PS), which TensorFlow has no equivalent of.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;
use ibex_worker::{ClusterSpec, Dtype, Init, Optimizer, TransportKind, VarSpec, Worker};
use serde::{Deserialize, Serialize};

use crate::Res;
use crate::models::{Model, params};
use crate::report::{self, Record};
use crate::transport::Transport;

/// `ibex-bench ps-step` flags.
#[derive(Args, Clone, Debug)]
pub struct PsStepArgs {
    /// Model whose variables are exchanged.
    #[arg(long, value_enum, default_value = "resnet50")]
    pub model: Model,
    /// shm, tcp, verbs (Ibex) or grpc (stock tonic); `ibex-shm`, `tonic`, ... work too.
    #[arg(long, value_enum, default_value = "ibex-shm")]
    pub transport: Transport,
    /// Worker processes (M).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// PS processes (N) when spawning them locally.
    #[arg(long, default_value_t = 2)]
    pub ps: usize,
    /// Running PS tasks as `host:port` (started with `ibex-ps --mode sync --num-workers M`);
    /// default: spawn N local `ibex-ps` processes.
    #[arg(long, value_delimiter = ',')]
    pub connect: Vec<String>,
    /// Measured steps (default 20, `--quick` 3).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Unmeasured steps first (default 3, `--quick` 1).
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    /// Few steps: for `compare --quick`.
    #[arg(long)]
    pub quick: bool,
    /// One `push_pull` per PS per step instead of TensorFlow's pull, then push.
    #[arg(long)]
    pub fused: bool,
    /// Run worker i under `ip netns exec NS_i` (one network namespace per worker, as
    /// `scripts/cluster-netns.sh` sets up); as many names as workers.
    #[arg(long, value_delimiter = ',')]
    pub worker_netns: Vec<String>,
    /// JSON lines on stdout instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The hidden `ps-worker` subcommand: one worker of a `ps-step` run.
#[derive(Args, Clone, Debug)]
pub struct PsWorkerArgs {
    #[arg(long, value_enum)]
    model: Model,
    #[arg(long, value_enum)]
    transport: Transport,
    /// PS tasks, `host:port`.
    #[arg(long, value_delimiter = ',', required = true)]
    ps: Vec<String>,
    #[arg(long)]
    workers: usize,
    #[arg(long)]
    index: usize,
    #[arg(long)]
    steps: usize,
    #[arg(long)]
    warmup_steps: usize,
    #[arg(long)]
    fused: bool,
}

/// What one worker reports to the parent (one JSON line).
#[derive(Serialize, Deserialize)]
struct WorkerResult {
    index: usize,
    /// Measured steps' durations.
    steps_ns: Vec<u64>,
    /// From the first measured step's start to the last one's end.
    window_s: f64,
    rss_kib: u64,
}

/// The PS transport a bench transport maps to; the PS serves gRPC only, so the raw
/// transports, the 1 MiB-frame tonic variant and the TLS ones have none.
pub fn kind(t: Transport) -> Option<TransportKind> {
    match t {
        Transport::Tonic => Some(TransportKind::Grpc),
        Transport::IbexShm => Some(TransportKind::Shm),
        Transport::IbexTcp => Some(TransportKind::Tcp),
        Transport::IbexVerbs => Some(TransportKind::Verbs),
        Transport::Tonic1m
        | Transport::IbexTcpTls
        | Transport::TonicTls
        | Transport::IbexShmBusy
        | Transport::RawShm
        | Transport::RawTcp
        | Transport::RawShmTypes => None,
    }
}

fn kind_or_err(t: Transport) -> Res<TransportKind> {
    kind(t).ok_or_else(|| {
        format!("ps-step runs the real ibex-ps, which serves gRPC only: use --transport shm, tcp, verbs or grpc, not {}", t.name()).into()
    })
}

/// The variables as the workers declare them: kernels Glorot-uniform, gammas 1, biases and
/// betas 0, SGD everywhere (its update is the cheapest, so the step time is the exchange).
pub fn var_specs(model: Model) -> Vec<VarSpec> {
    model
        .variables()
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let init = if v.name.ends_with("/kernel") {
                Init::GlorotUniform { seed: i as u64 }
            } else if v.name.ends_with("/gamma") {
                Init::Constant(1.0)
            } else {
                Init::Zeros
            };
            VarSpec {
                name: v.name,
                dtype: Dtype::F32,
                shape: v.shape,
                init,
                optimizer: Optimizer::Sgd { lr: 0.01 },
                sparse: false,
            }
        })
        .collect()
}

fn cluster(ps: &[String], workers: usize, kind: TransportKind) -> Res<ClusterSpec> {
    // Worker addresses only count the workers here: nothing dials them.
    let w = (0..workers)
        .map(|i| format!("127.0.0.1:{}", i + 1))
        .collect();
    Ok(ClusterSpec::new(ps.to_vec(), w, kind)?)
}

/// One worker process: create the variables, then timed steps; prints a [`WorkerResult`].
pub fn worker(a: PsWorkerArgs) -> Res<()> {
    // As a training process would at start-up (docs/ps.md): the step's message buffers are
    // reused instead of being mapped and faulted in again every step.
    ibex_transport::conn::keep_freed_memory();
    let spec = cluster(&a.ps, a.workers, kind_or_err(a.transport)?)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let r = rt.block_on(async {
        let w = Worker::connect(&spec, a.index, &ibex_worker::transport_config()?).await?;
        let vars = var_specs(a.model);
        w.create_variables(&vars).await?;
        let names: Vec<&str> = vars.iter().map(|v| v.name.as_str()).collect();
        let grads: Vec<Vec<f32>> = vars.iter().map(|v| vec![1e-3; v.numel()]).collect();
        let pairs: Vec<(&str, &[f32])> = names
            .iter()
            .copied()
            .zip(grads.iter().map(Vec::as_slice))
            .collect();
        // The model's variables, as a framework keeps them: pulled into the same memory
        // every step.
        let mut values: Vec<Vec<f32>> = vec![Vec::new(); names.len()];
        // A PS given with --connect may have served an earlier run: continue from its step.
        let mut step = w.current_step().await?;
        let mut steps_ns = Vec::with_capacity(a.steps);
        let mut first = Instant::now();
        for i in 0..a.warmup_steps + a.steps {
            let t = Instant::now();
            if i == a.warmup_steps {
                first = t;
            }
            if a.fused {
                w.push_pull_into(step, &pairs, &mut values).await?;
            } else {
                w.pull_into(&names, step, &mut values).await?;
                w.push(step, &pairs).await?;
            }
            step += 1;
            if i >= a.warmup_steps {
                steps_ns.push(t.elapsed().as_nanos() as u64);
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(WorkerResult {
            index: a.index,
            steps_ns,
            window_s: first.elapsed().as_secs_f64(),
            rss_kib: report::self_peak_rss_kib(),
        })
    })?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(&r)?)?;
    out.flush()?;
    Ok(())
}

/// The `ibex-ps` binary: `$IBEX_PS`, else beside this executable (the same target dir and
/// profile: `cargo build -p ibex-bench -p ibex-ps` puts both there).
pub fn ibex_ps_binary() -> Res<PathBuf> {
    if let Some(p) = std::env::var_os("IBEX_PS") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "IBEX_PS={} is not a file; point it at the ibex-ps binary",
                p.display()
            )
            .into())
        };
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().ok_or("this executable has no directory")?;
    // Test harnesses run from target/<profile>/deps; the binaries sit one level up.
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        let p = d.join("ibex-ps");
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(format!(
        "ibex-ps not found beside {}: build it with the same profile (`cargo build --release -p ibex-bench -p ibex-ps`, or without --release for a debug ibex-bench), or set IBEX_PS=/path/to/ibex-ps",
        exe.display()
    )
    .into())
}

/// A child process killed on drop, its stderr kept (last lines) for error messages.
struct Proc {
    what: String,
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    stderr_reader: Option<std::thread::JoinHandle<()>>,
    stdout: Option<std::thread::JoinHandle<Vec<String>>>,
}

impl Proc {
    fn spawn(what: String, mut cmd: Command) -> Res<Proc> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("starting {what}: {e}"))?;
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let stderr_reader = child.stderr.take().map(|err| {
            let keep = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    if let Ok(mut v) = keep.lock() {
                        if v.len() == 20 {
                            v.remove(0);
                        }
                        v.push(line);
                    }
                }
            })
        });
        let stdout = child.stdout.take().map(|out| {
            std::thread::spawn(move || BufReader::new(out).lines().map_while(Result::ok).collect())
        });
        Ok(Proc {
            what,
            child,
            stderr,
            stderr_reader,
            stdout,
        })
    }

    /// The last lines the process wrote to stderr; call once it has exited, so that the
    /// reader has seen them all.
    fn stderr_tail(&mut self) -> String {
        if let Some(r) = self.stderr_reader.take() {
            let _ = r.join();
        }
        let lines = self
            .stderr
            .lock()
            .map(|v| v.join("\n    "))
            .unwrap_or_default();
        if lines.is_empty() {
            String::new()
        } else {
            format!("; its stderr:\n    {lines}")
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SIGTERM first: ibex-ps then shuts down and its listener removes its shm socket
        // file, which SIGKILL would leave behind in the temp directory.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: plain syscall; the child is not reaped yet, so its pid is still ours.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `ps-step`: PS and workers as processes; prints one record.
pub fn run(a: PsStepArgs) -> Res<()> {
    let r = measure(&a)?;
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(out, "{}", serde_json::to_string(&r)?)?;
    } else {
        let vars = a.model.variables();
        writeln!(out, "{}", report::header())?;
        writeln!(out, "{}", report::row(&r))?;
        writeln!(
            out,
            "ps-step {} ({} tensors, {} parameters, {:.1} MB of f32 each way per worker) {} over {}: step p50 {:.1} ms, p99 {:.1} ms, {:.2} steps/s, {:.3} GB/s effective",
            a.model.name(),
            vars.len(),
            params(&vars),
            r.bytes as f64 / 1e6,
            r.topology,
            r.transport,
            r.p50_us / 1e3,
            r.p99_us / 1e3,
            r.rpc_s,
            r.mb_s / 1e3
        )?;
    }
    Ok(())
}

/// Spawns (or connects to) the PS, runs the workers, and folds their results into a record:
/// `calls` = measured steps, `rpc_s` = steps/s, percentiles per step, `mb_s` = effective
/// MB/s (every worker's pulled variables and pushed gradients, f32, per second), `bytes` =
/// the model's f32 bytes.
pub fn measure(a: &PsStepArgs) -> Res<Record> {
    let kind = kind_or_err(a.transport)?;
    if a.workers == 0 {
        return Err("--workers must be at least 1".into());
    }
    let steps = a.steps.unwrap_or(if a.quick { 3 } else { 20 });
    let warmup = a.warmup_steps.unwrap_or(if a.quick { 1 } else { 3 });
    if steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    let mut ps_procs = Vec::new();
    let mut metrics_ports = Vec::new();
    let addrs: Vec<String> = if a.connect.is_empty() {
        if a.ps == 0 {
            return Err("--ps must be at least 1".into());
        }
        let bin = ibex_ps_binary()?;
        // Every shard's address and metrics port in one call, so that no two of them are
        // the same port (the kernel readily hands a just-released port out again).
        let ports = ibex_worker::free_ports("127.0.0.1", 2 * a.ps)?;
        let (listen, metrics) = ports.split_at(a.ps);
        let addrs: Vec<String> = listen.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let spec = cluster(&addrs, a.workers, kind)?;
        for (i, &port) in metrics.iter().enumerate() {
            metrics_ports.push(port);
            let mut c = Command::new(&bin);
            c.args([
                "--listen",
                &spec.ps_uri(i),
                "--shard",
                &i.to_string(),
                "--num-workers",
                &a.workers.to_string(),
                "--mode",
                "sync",
            ]);
            c.args(["--sync-timeout-secs", "120"]);
            c.args(["--metrics", &format!("127.0.0.1:{port}")]);
            ps_procs.push(Proc::spawn(format!("ibex-ps shard {i}"), c)?);
        }
        addrs
    } else {
        a.connect.clone()
    };
    let exe = std::env::current_exe()?;
    if !a.worker_netns.is_empty() && a.worker_netns.len() != a.workers {
        return Err(format!(
            "--worker-netns names {} namespaces for {} workers",
            a.worker_netns.len(),
            a.workers
        )
        .into());
    }
    let mut workers = Vec::new();
    for i in 0..a.workers {
        let mut c = match a.worker_netns.get(i) {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&exe);
                c
            }
            None => Command::new(&exe),
        };
        c.args([
            "ps-worker",
            "--model",
            a.model.name(),
            "--transport",
            a.transport.name(),
            "--ps",
            &addrs.join(","),
        ]);
        c.args([
            "--workers",
            &a.workers.to_string(),
            "--index",
            &i.to_string(),
            "--steps",
            &steps.to_string(),
            "--warmup-steps",
            &warmup.to_string(),
        ]);
        if a.fused {
            c.arg("--fused");
        }
        workers.push(Proc::spawn(format!("worker {i}"), c)?);
    }
    // Generous: a debug build moving VGG-16 on a loaded 2-core machine takes seconds a step.
    let limit = Duration::from_secs(120 + 30 * (steps + warmup) as u64);
    let deadline = Instant::now() + limit;
    let mut done = vec![false; workers.len()];
    while done.iter().any(|d| !d) {
        for (w, d) in workers
            .iter_mut()
            .zip(done.iter_mut())
            .filter(|(_, d)| !**d)
        {
            if let Some(st) = w.child.try_wait()? {
                if !st.success() {
                    let tail = w.stderr_tail();
                    return Err(format!("ps-step: {} failed ({st}){tail}", w.what).into());
                }
                *d = true;
            }
        }
        for p in &mut ps_procs {
            if let Some(st) = p.child.try_wait()? {
                let tail = p.stderr_tail();
                return Err(format!("ps-step: {} exited early ({st}){tail}", p.what).into());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("ps-step: workers ran past {limit:?}; killed").into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let server_rss_kib = ps_procs
        .iter()
        .map(|p| report::peak_rss_kib(p.child.id()))
        .sum();
    report_registrations(&metrics_ports, steps + warmup);
    let mut results = Vec::new();
    for w in &mut workers {
        let lines = w
            .stdout
            .take()
            .ok_or("worker stdout")?
            .join()
            .map_err(|_| "worker reader thread panicked")?;
        let Some(line) = lines.iter().find(|l| l.starts_with('{')) else {
            let tail = w.stderr_tail();
            return Err(format!("ps-step: {} printed no result{tail}", w.what).into());
        };
        results.push(serde_json::from_str::<WorkerResult>(line)?);
    }
    fold(a, &results, server_rss_kib)
}

/// Where memory gets registered (verbs), what the PS shards' /metrics say about it over the
/// whole run (warm-up included): exposures that needed no registration, ones that did, and
/// `ibv_reg_mr` calls. Printed on stderr; nothing where no shard registers anything.
fn report_registrations(ports: &[u16], steps: usize) {
    let (mut hits, mut misses, mut regs, mut seen) = (0u64, 0u64, 0u64, false);
    for &port in ports {
        let Some(page) = scrape(port) else { continue };
        let sum = |prefix: &str| -> u64 {
            page.lines()
                .filter(|l| l.starts_with(prefix))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum()
        };
        seen |= page.contains("ibex_verbs_registrations_total");
        hits += sum("ibex_transport_reg_cache_hits_total")
            + sum("ibex_transport_exposed_from_pool_total");
        misses += sum("ibex_transport_reg_cache_misses_total");
        regs += sum("ibex_verbs_registrations_total");
    }
    if seen {
        eprintln!(
            "ps-step: PS shards over {steps} steps (warm-up included): pull exposures {hits} needing no registration, {misses} registering ({:.1}% hits); ibv_reg_mr {regs} in all",
            100.0 * hits as f64 / (hits + misses).max(1) as f64
        );
    }
}

/// A shard's /metrics page, or `None` if it does not answer within a few seconds.
fn scrape(port: u16) -> Option<String> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

fn fold(a: &PsStepArgs, results: &[WorkerResult], server_rss_kib: u64) -> Res<Record> {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3)?;
    for r in results {
        for &ns in &r.steps_ns {
            hist.saturating_record(ns);
        }
    }
    let steps = results.iter().map(|r| r.steps_ns.len()).min().unwrap_or(0);
    let window = results
        .iter()
        .map(|r| r.window_s)
        .fold(0.0, f64::max)
        .max(1e-9);
    let bytes = params(&a.model.variables()) * 4;
    let steps_s = steps as f64 / window;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1e3;
    let n_ps = if a.connect.is_empty() {
        a.ps
    } else {
        a.connect.len()
    };
    Ok(Record {
        bench: "ps-step".into(),
        transport: a.transport.name().into(),
        payload: if a.fused {
            format!("{} fused", a.model.name())
        } else {
            a.model.name().into()
        },
        bytes,
        window: 1,
        topology: format!("{}x{}", results.len(), n_ps),
        calls: steps as u64,
        p50_us: us(0.5),
        p99_us: us(0.99),
        p999_us: us(0.999),
        mean_us: hist.mean() / 1e3,
        mb_s: (2 * bytes * results.len()) as f64 * steps_s / 1e6,
        rpc_s: steps_s,
        client_rss_kib: results.iter().map(|r| r.rss_kib).sum(),
        server_rss_kib,
        round: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn var_specs_follow_the_model() {
        let v = var_specs(Model::Resnet50);
        assert_eq!(v.len(), 161);
        assert_eq!(v.iter().map(VarSpec::numel).sum::<usize>(), 25_557_032);
        assert!(
            v.iter()
                .all(|s| s.optimizer == Optimizer::Sgd { lr: 0.01 } && !s.sparse)
        );
    }

    #[test]
    fn only_grpc_transports_map_to_the_ps() {
        assert_eq!(kind(Transport::Tonic), Some(TransportKind::Grpc));
        assert_eq!(kind(Transport::IbexShm), Some(TransportKind::Shm));
        assert!(kind(Transport::RawTcp).is_none());
        assert!(
            kind_or_err(Transport::Tonic1m)
                .unwrap_err()
                .to_string()
                .contains("gRPC only")
        );
    }

    #[test]
    fn fold_counts_steps_and_both_directions() {
        let a = PsStepArgs {
            model: Model::Vgg16,
            transport: Transport::IbexTcp,
            workers: 2,
            ps: 2,
            connect: vec![],
            steps: None,
            warmup_steps: None,
            quick: false,
            fused: false,
            worker_netns: vec![],
            json: true,
        };
        let w = |i| WorkerResult {
            index: i,
            steps_ns: vec![1_000_000; 4],
            window_s: 0.004,
            rss_kib: 10,
        };
        let r = fold(&a, &[w(0), w(1)], 7).unwrap();
        assert_eq!(
            (
                r.calls,
                r.topology.as_str(),
                r.server_rss_kib,
                r.client_rss_kib
            ),
            (4, "2x2", 7, 20)
        );
        assert!((r.rpc_s - 1000.0).abs() < 1e-6);
        // 2 workers x (pull + push) x 553.4 MB x 1000 steps/s.
        assert!(
            (r.mb_s - 4.0 * 138_357_544.0 * 4.0 * 1000.0 / 1e6).abs() < 1.0,
            "{}",
            r.mb_s
        );
        assert!((r.p50_us - 1000.0).abs() < 1.0);
    }
}
