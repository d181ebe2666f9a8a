//! `ibex-bench`: TF-gRPC-Bench and OSU-style microbenchmarks over stock tonic and Ibex.
//!
//! Every benchmark talks to a server in another process: either one it spawns itself (this
//! binary re-run as `ibex-bench server`), or one started by hand on another host and named
//! with `--connect`. `compare` runs a set of benchmarks over every available transport, each
//! client in its own process too, and prints a ratio table against stock tonic. See
//! docs/benchmarks.md.

#![warn(missing_docs)]

mod auto;
mod floor;
mod models;
mod payload;
mod ps_step;
mod report;
mod run;
mod server;
mod stream;
mod transport;

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand};

use payload::{Category, PayloadSpec, Scheme};
use report::Record;
use run::{Op, Shape, Timing};
use transport::{Client, Transport};

/// Errors end the process with their message; nothing here is worth a backtrace.
pub type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Parser)]
#[command(
    name = "ibex-bench",
    version,
    about = "TF-gRPC-Bench and OSU-style benchmarks: stock tonic against Ibex"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the Bench service (or the raw peer) until killed; prints the connect address.
    Server {
        /// Transport to serve.
        #[arg(long, value_enum)]
        transport: Transport,
        /// Listen address (`127.0.0.1:0` for tonic, an Ibex URI otherwise). Default: local.
        #[arg(long)]
        listen: Option<String>,
        /// Runtime worker threads; 0: a single-threaded runtime.
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// TF-gRPC-Bench P2P latency: the server echoes the payload.
    Latency(BenchArgs),
    /// TF-gRPC-Bench P2P bandwidth: the server only acknowledges (`--window 64`: OSU-style
    /// windowed bandwidth).
    Bw(BenchArgs),
    /// Bidirectional bandwidth: windowed Echo, both directions counted (default window 64).
    Bibw(BenchArgs),
    /// TF-gRPC-Bench PS throughput: every worker calls every server process at once.
    PsThroughput(BenchArgs),
    /// OSU-style sweep: Echo latency and windowed Sink bandwidth per power-of-two size.
    Sweep(BenchArgs),
    /// A tensor through registered buffers (Ibex: descriptor + server-side read_remote;
    /// stock tonic: Sink of the same bytes), beside single-thread memcpy.
    Tensor(BenchArgs),
    /// One synchronous training step of a real model (push every gradient, pull every
    /// variable) for M worker processes against N `ibex-ps` processes, no compute.
    PsStep(ps_step::PsStepArgs),
    /// One worker of `ps-step` (started by it).
    #[command(hide = true)]
    PsWorker(ps_step::PsWorkerArgs),
    /// Run benchmarks over every available transport in one go; ratio table against tonic.
    Compare(CompareArgs),
    /// Which provider `connect_auto` picks to a `listen_auto` endpoint (one echo over it).
    Auto {
        /// Be the endpoint: `listen_auto` here (`0.0.0.0:7200`) until killed.
        #[arg(long, conflicts_with = "connect")]
        listen: Option<String>,
        /// `connect_auto` to this `host:port`.
        #[arg(long, required_unless_present = "listen")]
        connect: Option<String>,
        /// Fail unless the connection's provider is this (shm, tcp, verbs).
        #[arg(long)]
        expect: Option<String>,
    },
    /// The tcp floor: one plain TCP stream (tokio, `--size` writes) to a receiver that
    /// drops the bytes. `compare` runs it beside ibex-tcp's ps-step.
    TcpStream {
        /// Bytes per write (and per read on the receiving side).
        #[arg(long, value_parser = parse_size, default_value = "1M")]
        size: usize,
        /// A receiver started by hand (`tcp-stream --listen`); default: spawn a local one.
        #[arg(long)]
        connect: Option<String>,
        /// Be the receiver: listen here (`0.0.0.0:7100`) until killed, print the address.
        #[arg(long, conflicts_with = "connect")]
        listen: Option<String>,
        /// Unmeasured seconds first.
        #[arg(long, default_value_t = 0.5)]
        warmup: f64,
        /// Measured seconds.
        #[arg(long, default_value_t = 2.0)]
        duration: f64,
        /// JSON lines on stdout instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// The physical floor of a round trip: two processes ping-pong over one shared cache
    /// line, spinning and sleeping on a futex (no transport). `compare` runs it beside the
    /// latency runs.
    Floor {
        /// Unmeasured seconds first.
        #[arg(long, default_value_t = 0.5)]
        warmup: f64,
        /// Measured seconds per waiting mode.
        #[arg(long, default_value_t = 2.0)]
        duration: f64,
        /// JSON lines on stdout instead of a table.
        #[arg(long)]
        json: bool,
        /// Only this waiting mode (default: both).
        #[arg(long, value_enum)]
        wait: Option<floor::Wait>,
    },
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.trim_end_matches(['B', 'b', 'i']).char_indices().last() {
        Some((i, 'K' | 'k')) => (&s[..i], 1usize << 10),
        Some((i, 'M' | 'm')) => (&s[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&s[..i], 1 << 30),
        _ => (s.trim_end_matches('B'), 1),
    };
    num.parse::<usize>()
        .map(|n| n * mult)
        .map_err(|_| format!("`{s}` is not a size; write 64, 4K, 16M or 16MiB"))
}

#[derive(Args, Clone)]
struct BenchArgs {
    /// Transport.
    #[arg(long, value_enum, default_value = "ibex-shm")]
    transport: Transport,
    /// Server address(es), comma separated (ps-throughput: one per PS). Default: spawn local
    /// servers.
    #[arg(long, value_delimiter = ',')]
    connect: Vec<String>,
    /// Payload scheme.
    #[arg(long, value_enum, default_value = "skew")]
    scheme: Scheme,
    /// Category for `--scheme uniform`.
    #[arg(long, value_enum, default_value = "small")]
    category: Category,
    /// Buffers per payload.
    #[arg(long, default_value_t = 10)]
    buffers: usize,
    /// Large,Medium,Small percentages for `--scheme skew`.
    #[arg(long, value_delimiter = ',', default_value = "60,30,10")]
    skew: Vec<u32>,
    /// Draw buffer sizes from each category's range instead of its default size.
    #[arg(long)]
    randomize_sizes: bool,
    /// Seed of the payload generator.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// One buffer of this many bytes instead of a scheme payload (tensor: the tensor size,
    /// default 16M).
    #[arg(long, value_parser = parse_size)]
    size: Option<usize>,
    /// Calls outstanding per connection (bw: 1; bibw and sweep bandwidth: 64).
    #[arg(long)]
    window: Option<usize>,
    /// ps-throughput: worker count.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// ps-throughput: PS (server process) count when spawning locally.
    #[arg(long, default_value_t = 2)]
    ps: usize,
    /// Sweep: smallest size.
    #[arg(long, value_parser = parse_size, default_value = "1")]
    min_size: usize,
    /// Sweep: largest size.
    #[arg(long, value_parser = parse_size, default_value = "64M")]
    max_size: usize,
    /// Sweep: size factor between points.
    #[arg(long, default_value_t = 2)]
    step: usize,
    /// Unmeasured seconds first.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Measured seconds per run (sweep: per point).
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Runs, summed (the paper reports the mean of 5).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// JSON lines on stdout instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct CompareArgs {
    /// Short settings: the whole run stays under 2 minutes on a 2-core machine.
    #[arg(long)]
    quick: bool,
    /// CI check: every benchmark kind once per transport with tiny sizes; exits non-zero
    /// unless each produced its record. Asserts no timing.
    #[arg(long, conflicts_with = "quick")]
    smoke: bool,
    /// Transports (default: every available one).
    #[arg(long, value_enum, value_delimiter = ',')]
    transports: Vec<Transport>,
    /// Benchmarks: latency, bw, bibw, ps-throughput, sweep, tensor, ps-step (default: all).
    #[arg(long, value_delimiter = ',')]
    benches: Vec<String>,
    /// Measured seconds per point (default 2, quick 0.2).
    #[arg(long)]
    duration: Option<f64>,
    /// Warm-up seconds per point (default 0.5, quick 0.05).
    #[arg(long)]
    warmup: Option<f64>,
    /// Alternating rounds for the call path's bars after the main run: every transport the
    /// bars compare (64 B Echo, small PS throughput 3x2, and the floor) once per round,
    /// with fresh servers, in a rotating order; those bars are judged on each point's
    /// median over the rounds. Default: 5, quick 3, smoke 1 (0: none).
    #[arg(long)]
    rounds: Option<u32>,
    /// Largest sweep size (default 64M, quick 16M).
    #[arg(long, value_parser = parse_size)]
    max_size: Option<usize>,
    /// Where results.jsonl, latency.svg and bandwidth.svg go.
    #[arg(long, default_value = "target/ibex-bench")]
    out: PathBuf,
    /// Also print every record as a JSON line on stdout.
    #[arg(long)]
    json: bool,
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Server {
            transport,
            listen,
            threads,
        } => server::serve(transport, listen, threads),
        Cmd::Compare(a) => compare(a),
        Cmd::Floor {
            warmup,
            duration,
            json,
            wait,
        } => floor(warmup, duration, json, wait),
        Cmd::Auto {
            listen,
            connect,
            expect,
        } => match (listen, connect) {
            (Some(l), _) => auto::serve(&l),
            (None, Some(c)) => auto::check(&c, expect.as_deref()),
            (None, None) => Err("auto needs --listen or --connect".into()),
        },
        Cmd::TcpStream {
            size,
            connect,
            listen,
            warmup,
            duration,
            json,
        } => match listen {
            Some(addr) => stream::listen(&addr, size),
            None => tcp_stream(connect.as_deref(), size, warmup, duration, json),
        },
        Cmd::Latency(a) => bench("latency", a),
        Cmd::Bw(a) => bench("bw", a),
        Cmd::Bibw(a) => bench("bibw", a),
        Cmd::PsThroughput(a) => bench("ps-throughput", a),
        Cmd::Sweep(a) => bench("sweep", a),
        Cmd::Tensor(a) => bench("tensor", a),
        Cmd::PsStep(a) => ps_step::run(a),
        Cmd::PsWorker(a) => ps_step::worker(a),
    };
    if let Err(e) = r {
        eprintln!("ibex-bench: {e}");
        std::process::exit(1);
    }
}

/// `ibex-bench floor`: both waiting modes (or `only` one), as records.
fn floor(warmup: f64, duration: f64, json: bool, only: Option<floor::Wait>) -> Res<()> {
    let (w, d) = (
        Duration::from_secs_f64(warmup),
        Duration::from_secs_f64(duration),
    );
    let mut records = Vec::new();
    for how in [floor::Wait::Spin, floor::Wait::Futex] {
        if only.is_none_or(|o| o == how) {
            records.push(floor::measure(how, w, d)?);
        }
    }
    let mut out = std::io::stdout().lock();
    if !json {
        writeln!(out, "{}", report::header())?;
    }
    for r in &records {
        if json {
            writeln!(out, "{}", serde_json::to_string(r)?)?;
        } else {
            writeln!(out, "{}", report::row(r))?;
        }
    }
    Ok(())
}

/// `ibex-bench tcp-stream` as the sender: one record.
fn tcp_stream(
    connect: Option<&str>,
    size: usize,
    warmup: f64,
    duration: f64,
    json: bool,
) -> Res<()> {
    let r = stream::measure(
        connect,
        size,
        Duration::from_secs_f64(warmup),
        Duration::from_secs_f64(duration),
    )?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("{}\n{}", report::header(), report::row(&r));
    }
    Ok(())
}

/// The tcp floor beside ibex-tcp's large transfers: one plain stream of 1 MiB writes.
fn run_tcp_stream(duration: f64, warmup: f64) -> Res<Vec<Record>> {
    let args = [
        "tcp-stream",
        "--json",
        "--duration",
        &duration.to_string(),
        "--warmup",
        &warmup.to_string(),
    ]
    .map(String::from);
    run_client(&args, Duration::from_secs(60))
}

/// A local server process; killed on drop.
struct LocalServer {
    child: Child,
    addr: String,
}

impl LocalServer {
    fn spawn(t: Transport) -> Res<LocalServer> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["server", "--transport", t.name()])
            .stdout(Stdio::piped())
            .spawn()?;
        let out = child.stdout.take().ok_or("server stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let addr = line.trim().to_string();
        if addr.is_empty() {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the {} server exited before printing its address (see its error above)",
                t.name()
            )
            .into());
        }
        Ok(LocalServer { child, addr })
    }
    /// Two servers: PS throughput uses both, the other benches the first.
    fn pair(t: Transport) -> Res<Vec<LocalServer>> {
        (0..2).map(|_| LocalServer::spawn(t)).collect()
    }
    fn rss_kib(&self) -> u64 {
        report::peak_rss_kib(self.child.id())
    }
}

impl Drop for LocalServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A killed server runs no clean-up: its shm socket file is ours to remove.
        if let Some(path) = self.addr.strip_prefix("shm://") {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Runs one benchmark subcommand: spawns local servers unless `--connect` names them.
fn bench(name: &str, a: BenchArgs) -> Res<()> {
    let want = if name == "ps-throughput" {
        a.ps.max(1)
    } else {
        1
    };
    let mut servers = Vec::new();
    let addrs = if a.connect.is_empty() {
        for _ in 0..want {
            servers.push(LocalServer::spawn(a.transport)?);
        }
        servers.iter().map(|s| s.addr.clone()).collect()
    } else {
        a.connect.clone()
    };
    let concurrent =
        (name != "latency" && name != "tensor") || std::env::var_os("IBEX_BENCH_MT").is_some();
    let rt = if concurrent {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    };
    let mut records = rt.block_on(client(name, &a, &addrs))?;
    let srss: u64 = servers.iter().map(LocalServer::rss_kib).sum();
    for r in &mut records {
        r.server_rss_kib = srss;
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        for r in &records {
            writeln!(out, "{}", serde_json::to_string(r)?)?;
        }
    } else {
        writeln!(out, "{}", report::header())?;
        for r in &records {
            writeln!(out, "{}", report::row(r))?;
        }
    }
    Ok(())
}

async fn client(name: &str, a: &BenchArgs, addrs: &[String]) -> Res<Vec<Record>> {
    let spec = PayloadSpec {
        scheme: a.scheme,
        category: a.category,
        buffers: a.buffers,
        skew: [
            a.skew.first().copied().unwrap_or(60),
            a.skew.get(1).copied().unwrap_or(30),
            a.skew.get(2).copied().unwrap_or(10),
        ],
        randomize_sizes: a.randomize_sizes,
        seed: a.seed,
    };
    let timing = Timing {
        warmup: Duration::from_secs_f64(a.warmup),
        duration: Duration::from_secs_f64(a.duration),
        runs: a.runs,
    };
    let t = a.transport;
    let addr = addrs.first().ok_or("no server address")?;
    let shape =
        |bench: &'static str, payload: String, window: usize, bytes: usize, per_call: usize| {
            Shape {
                bench,
                transport: t,
                payload,
                window,
                topology: "1x1".into(),
                bytes_per_call: per_call,
                bytes,
            }
        };
    let mut out = Vec::new();
    match name {
        "latency" | "bw" | "bibw" => {
            let c = Client::connect(t, addr).await?;
            let echo = name != "bw";
            let (msg, label) = run::p2p_msg(&spec, a.size, echo);
            let window = a.window.unwrap_or(if name == "bibw" { 64 } else { 1 });
            let window = if name == "latency" { 1 } else { window };
            let bytes = msg.bytes;
            let op = if echo { Op::Echo(msg) } else { Op::Sink(msg) };
            let s = run::measure(run::windowed(&c, window), op, timing).await?;
            let per_call = if name == "bibw" { 2 * bytes } else { bytes };
            out.push(run::record(
                &s,
                shape(
                    if name == "latency" {
                        "latency"
                    } else if echo {
                        "bibw"
                    } else {
                        "bw"
                    },
                    label,
                    window,
                    bytes,
                    per_call,
                ),
            ));
            c.close().await;
        }
        "ps-throughput" => {
            let mut groups = Vec::new();
            for _ in 0..a.workers.max(1) {
                let mut g = Vec::new();
                for addr in addrs {
                    g.push(Client::connect(t, addr).await?);
                }
                groups.push(g);
            }
            let (msg, label) = run::p2p_msg(&spec, a.size, true);
            let bytes = msg.bytes;
            let s = run::measure(groups, Op::Echo(msg), timing).await?;
            let mut sh = shape("ps-throughput", label, 1, bytes, bytes);
            sh.topology = format!("{}x{}", a.workers.max(1), addrs.len());
            out.push(run::record(&s, sh));
        }
        "sweep" => {
            let c = Client::connect(t, addr).await?;
            let per_point = Timing {
                warmup: timing.warmup.min(Duration::from_millis(200)),
                ..timing
            };
            for size in run::sweep_sizes(a.min_size, a.max_size, a.step) {
                let (m, label) = run::p2p_msg(&spec, Some(size), true);
                let s = run::measure(run::windowed(&c, 1), Op::Echo(m), per_point).await?;
                out.push(run::record(&s, shape("sweep-lat", label, 1, size, size)));
                let (m, label) = run::p2p_msg(&spec, Some(size), false);
                let w = run::osu_window(a.window.unwrap_or(64), size);
                let s = run::measure(run::windowed(&c, w), Op::Sink(m), per_point).await?;
                out.push(run::record(&s, shape("sweep-bw", label, w, size, size)));
            }
            c.close().await;
        }
        "tensor" => {
            let size = a.size.unwrap_or(16 << 20);
            let c = Client::connect(t, addr).await?;
            let data = c.tensor_buffer(size)?;
            let s = run::measure(run::windowed(&c, 1), Op::Tensor(data), timing).await?;
            let label = if matches!(c, Client::Tonic(_)) {
                "Sink body"
            } else {
                "registered"
            };
            out.push(run::record(
                &s,
                shape("tensor", label.into(), 1, size, size),
            ));
            c.close().await;
            let mb = run::memcpy_mb_s(size, timing);
            let mut r = run::record(&s, shape("memcpy", "1 thread".into(), 1, size, size));
            (r.mb_s, r.calls, r.rpc_s) = (mb, 0, mb * 1e6 / size as f64);
            (r.p50_us, r.p99_us, r.p999_us, r.mean_us) = (0.0, 0.0, 0.0, 0.0);
            r.transport = "local".into();
            out.push(r);
        }
        other => return Err(format!("unknown benchmark `{other}`").into()),
    }
    Ok(out)
}

/// How long and how large a `compare` run is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Full,
    Quick,
    Smoke,
}

/// One client run of the compare plan: subcommand and its arguments.
fn plan(benches: &[String], mode: Mode, max_size: usize) -> Vec<(&'static str, Vec<String>)> {
    let on = |b: &str| benches.is_empty() || benches.iter().any(|x| x == b);
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let (quick, smoke) = (mode != Mode::Full, mode == Mode::Smoke);
    let mut p = Vec::new();
    if on("latency") {
        p.push(lat64_point());
        if !smoke {
            p.push(("latency", s(&["--scheme", "skew"])));
        }
        if !quick {
            p.push((
                "latency",
                s(&["--scheme", "uniform", "--category", "small"]),
            ));
            p.push(("latency", s(&["--scheme", "random"])));
        }
    }
    if on("bw") {
        if smoke {
            p.push(("bw", s(&["--size", "1K"])));
        } else {
            p.push(("bw", s(&["--scheme", "skew"])));
            p.push(("bw", s(&["--size", "16M"])));
            p.push(("bw", s(&["--size", "64K", "--window", "64"])));
        }
        if !quick {
            p.push(("bw", s(&["--scheme", "uniform", "--category", "medium"])));
            p.push(("bw", s(&["--size", "1M", "--window", "64"])));
        }
    }
    if on("bibw") {
        let (size, window) = match mode {
            Mode::Smoke => ("1K", "4"),
            Mode::Quick => ("64K", "64"),
            Mode::Full => ("1M", "64"),
        };
        p.push(("bibw", s(&["--size", size, "--window", window])));
    }
    if on("ps-throughput") {
        p.push(ps_small_point(mode));
        if !quick {
            p.push((
                "ps-throughput",
                s(&["--scheme", "skew", "--workers", "3", "--ps", "2"]),
            ));
        }
    }
    if on("tensor") {
        p.push(("tensor", s(&["--size", if smoke { "64K" } else { "16M" }])));
    }
    if on("sweep") {
        let m = max_size.to_string();
        let step = match mode {
            Mode::Smoke => "32",
            Mode::Quick => "16",
            Mode::Full => "2",
        };
        p.push(("sweep", s(&["--max-size", &m, "--step", step])));
    }
    if on("ps-step") {
        let mut a = s(&["--model", "resnet50", "--workers", "2", "--ps", "2"]);
        match mode {
            Mode::Smoke => a.extend(s(&["--steps", "1", "--warmup-steps", "0"])),
            Mode::Quick => a.push("--quick".into()),
            Mode::Full => {}
        }
        p.push(("ps-step", a));
    }
    p
}

/// The 64 B Echo, which the call path's bars read.
fn lat64_point() -> (&'static str, Vec<String>) {
    ("latency", vec!["--size".into(), "64".into()])
}

/// Small-message PS throughput, 3 workers x 2 PS (2 x 2 for smoke), which the bars read.
fn ps_small_point(mode: Mode) -> (&'static str, Vec<String>) {
    let workers = if mode == Mode::Smoke { "2" } else { "3" };
    let args = [
        "--scheme",
        "uniform",
        "--category",
        "small",
        "--workers",
        workers,
        "--ps",
        "2",
    ];
    ("ps-throughput", args.map(String::from).to_vec())
}

/// The record names a plan entry produces.
fn produces(bench: &str) -> &'static [&'static str] {
    match bench {
        "latency" => &["latency", "floor"],
        "bw" => &["bw"],
        "bibw" => &["bibw"],
        "ps-throughput" => &["ps-throughput"],
        "tensor" => &["tensor", "memcpy"],
        "sweep" => &["sweep-lat", "sweep-bw"],
        "ps-step" => &["ps-step"],
        _ => &[],
    }
}

/// Whether a plan entry runs over `t`: `ps-step` needs a transport the PS serves.
fn applies(bench: &str, t: Transport) -> bool {
    // The floor of a tonic-compatible layer is measured where the call path's bars are.
    if t == Transport::RawShmTypes {
        return matches!(bench, "latency" | "ps-throughput");
    }
    bench != "ps-step" || ps_step::kind(t).is_some()
}

/// `--smoke`'s check: every benchmark kind of the plan left a record for every transport it
/// applies to. Returns what is missing, as `transport: record`.
fn missing(
    plan: &[(&'static str, Vec<String>)],
    transports: &[Transport],
    records: &[Record],
) -> Vec<String> {
    let mut out = Vec::new();
    for &t in transports {
        for (bench, _) in plan {
            if !applies(bench, t) {
                continue;
            }
            for want in produces(bench) {
                let have = records.iter().any(|r| {
                    r.bench == *want && (r.transport == t.name() || r.transport == "local")
                });
                let line = format!("{}: {want}", t.name());
                if !have && !out.contains(&line) {
                    out.push(line);
                }
            }
        }
    }
    out
}

/// The bare shared-memory ping-pong floor, spinning and sleeping (or `only` one of them).
fn run_floor(duration: f64, warmup: f64, only: Option<&str>) -> Res<Vec<Record>> {
    let mut args: Vec<String> = [
        "floor",
        "--json",
        "--duration",
        &duration.to_string(),
        "--warmup",
        &warmup.to_string(),
    ]
    .map(String::from)
    .to_vec();
    if let Some(how) = only {
        args.extend(["--wait".to_string(), how.to_string()]);
    }
    run_client(&args, Duration::from_secs(60))
}

/// The spinning floor measured just before `t`'s 64 B latency point, labelled as such
/// ([`report::beside`]): the busy-polling bar divides each round's latency by the floor
/// of the same moment. A VM can move between states in which a move between its two
/// cores takes about 0.13 or 0.53 µs, for tens of seconds at a time: a round's first
/// floor and a point half a minute later can see different machines.
fn run_floor_beside(t: Transport, duration: f64, warmup: f64) -> Res<Vec<Record>> {
    let mut recs = run_floor(duration, warmup, Some("spin"))?;
    for r in &mut recs {
        r.payload = report::beside(&r.payload, t.name());
    }
    Ok(recs)
}

/// One plan entry over `t` against `servers` (PS throughput uses two of them), with the
/// servers' peak RSS filled in.
fn run_point(
    t: Transport,
    servers: &[LocalServer],
    bench: &str,
    extra: &[String],
    duration: f64,
    warmup: f64,
) -> Res<Vec<Record>> {
    let n = if bench == "ps-throughput" { 2 } else { 1 };
    let mut args: Vec<String> = vec![
        bench.to_string(),
        "--transport".into(),
        t.name().into(),
        "--json".into(),
    ];
    let limit = if bench == "ps-step" {
        // It starts its own PS and workers, and counts steps, not seconds.
        Duration::from_secs(900)
    } else {
        let connect: Vec<&str> = servers.iter().take(n).map(|s| s.addr.as_str()).collect();
        args.extend(
            [
                "--connect",
                &connect.join(","),
                "--duration",
                &duration.to_string(),
                "--warmup",
                &warmup.to_string(),
            ]
            .map(String::from),
        );
        let points = if bench == "sweep" { 60.0 } else { 1.0 };
        Duration::from_secs_f64(60.0 + points * (duration + warmup) * 4.0)
    };
    args.extend(extra.iter().cloned());
    let mut recs = run_client(&args, limit)?;
    let srss: u64 = servers.iter().take(n).map(LocalServer::rss_kib).sum();
    for r in &mut recs {
        // ps-step measured its own PS processes.
        if r.bench != "ps-step" {
            r.server_rss_kib = srss;
        }
    }
    Ok(recs)
}

/// Runs one client process and collects its JSON records. A client that fails or hangs
/// costs its own rows, not the whole comparison.
fn run_client(args: &[String], limit: Duration) -> Res<Vec<Record>> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()?;
    let out = child.stdout.take().ok_or("client stdout")?;
    let reader = std::thread::spawn(move || {
        BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("client `{}` ran past {limit:?}; killed", args.join(" ")).into());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let lines = reader.join().map_err(|_| "client reader thread panicked")?;
    if !status.success() {
        return Err(format!("client `{}` failed ({status})", args.join(" ")).into());
    }
    let mut v = Vec::new();
    for l in lines.iter().filter(|l| l.starts_with('{')) {
        v.push(serde_json::from_str(l)?);
    }
    Ok(v)
}

fn compare(a: CompareArgs) -> Res<()> {
    let transports = if a.transports.is_empty() {
        Transport::available()
    } else {
        a.transports.clone()
    };
    let mode = if a.smoke {
        Mode::Smoke
    } else if a.quick {
        Mode::Quick
    } else {
        Mode::Full
    };
    let (duration, warmup, max_size) = match mode {
        Mode::Full => (2.0, 0.5, 64 << 20),
        Mode::Quick => (0.2, 0.05, 16 << 20),
        Mode::Smoke => (0.05, 0.0, 1 << 10),
    };
    let (duration, warmup, max_size) = (
        a.duration.unwrap_or(duration),
        a.warmup.unwrap_or(warmup),
        a.max_size.unwrap_or(max_size),
    );
    let plan = plan(&a.benches, mode, max_size);
    if let Some(unknown) = a.benches.iter().find(|b| produces(b).is_empty()) {
        return Err(format!("unknown benchmark `{unknown}` in --benches: use latency, bw, bibw, ps-throughput, sweep, tensor, ps-step").into());
    }
    if plan.iter().any(|(b, _)| *b == "ps-step")
        && transports.iter().any(|&t| applies("ps-step", t))
    {
        ps_step::ibex_ps_binary()
            .map_err(|e| format!("{e} (or leave ps-step out with --benches)"))?;
    }
    let mut served = Vec::new();
    let started = Instant::now();
    let mut all: Vec<Record> = Vec::new();
    let mut failures = Vec::new();
    println!("{}", report::header());
    if plan.iter().any(|(b, _)| *b == "latency") {
        // The floor the latency runs are judged against, measured in this same run.
        match run_floor(duration, warmup, None) {
            Ok(recs) => {
                for r in recs {
                    println!("{}", report::row(&r));
                    all.push(r);
                }
            }
            Err(e) => failures.push(format!("floor: {e}")),
        }
    }
    for &t in &transports {
        // No servers for a transport that none of the plan's benchmarks runs over (the
        // types floor outside latency and PS throughput, or a plan of ps-step alone).
        if !plan.iter().any(|(bench, _)| applies(bench, t)) {
            continue;
        }
        // One set of server processes per transport, shared by its benches; PS throughput
        // uses two of them.
        let servers = match LocalServer::pair(t) {
            Ok(s) => s,
            Err(e) => {
                failures.push(format!("{}: server: {e}", t.name()));
                continue;
            }
        };
        served.push(t);
        for (bench, extra) in &plan {
            if !applies(bench, t) {
                continue;
            }
            if *bench == "ps-step" && t == Transport::IbexTcp {
                // The floor ibex-tcp's step is judged against, measured right before it.
                match run_tcp_stream(duration, warmup) {
                    Ok(recs) => {
                        for r in recs {
                            println!("{}", report::row(&r));
                            all.push(r);
                        }
                    }
                    Err(e) => failures.push(format!("tcp-stream: {e}")),
                }
            }
            match run_point(t, &servers, bench, extra, duration, warmup) {
                Ok(recs) => {
                    for r in recs {
                        println!("{}", report::row(&r));
                        all.push(r);
                    }
                }
                Err(e) => {
                    eprintln!("ibex-bench compare: {e}");
                    failures.push(format!("{}: {e}", t.name()));
                }
            }
        }
    }
    let rounds = a.rounds.unwrap_or(match mode {
        Mode::Full => 5,
        Mode::Quick => 3,
        Mode::Smoke => 1,
    });
    let points: Vec<_> = plan
        .iter()
        .filter(|p| **p == lat64_point() || **p == ps_small_point(mode))
        .cloned()
        .collect();
    let round_transports: Vec<Transport> = served
        .iter()
        .copied()
        .filter(|t| report::ROUND_TRANSPORTS.contains(&t.name()))
        .collect();
    if rounds > 0 && !points.is_empty() && !round_transports.is_empty() {
        // Shorter points than the main run's: what the rounds buy is nearness in time.
        let (d, w) = (duration.min(1.0), warmup.min(0.25));
        println!(
            "\nalternating rounds for the call path's bars ({rounds} x {} transports, {d} s a point):",
            round_transports.len()
        );
        for n in 1..=rounds {
            let mut got = Vec::new();
            if points.contains(&lat64_point()) {
                match run_floor(d, w, None) {
                    Ok(recs) => got.extend(recs),
                    Err(e) => failures.push(format!("round {n}: floor: {e}")),
                }
            }
            // A rotating order, so that no transport always runs first or last.
            let k = round_transports.len();
            for i in 0..k {
                let t = round_transports[(i + n as usize) % k];
                let servers = match LocalServer::pair(t) {
                    Ok(s) => s,
                    Err(e) => {
                        failures.push(format!("round {n}: {}: server: {e}", t.name()));
                        continue;
                    }
                };
                for (bench, extra) in &points {
                    if report::FLOOR_BESIDE.contains(&t.name())
                        && (*bench, extra.clone()) == lat64_point()
                    {
                        match run_floor_beside(t, d, w) {
                            Ok(recs) => got.extend(recs),
                            Err(e) => failures.push(format!("round {n}: floor beside: {e}")),
                        }
                    }
                    match run_point(t, &servers, bench, extra, d, w) {
                        Ok(recs) => got.extend(recs),
                        Err(e) => failures.push(format!("round {n}: {}: {e}", t.name())),
                    }
                }
            }
            println!("round {n}:");
            for mut r in got {
                r.round = Some(n);
                println!("{}", report::row(&r));
                all.push(r);
            }
        }
    }
    // Smoke sizes and durations say nothing about speed; only the records count there.
    if mode != Mode::Smoke {
        let main: Vec<Record> = all.iter().filter(|r| r.round.is_none()).cloned().collect();
        print!("{}", report::ratios(&main));
        print!("{}", report::bars(&all));
    }
    std::fs::create_dir_all(&a.out)?;
    let mut jl = String::new();
    for r in &all {
        let line = serde_json::to_string(r)?;
        if a.json {
            println!("{line}");
        }
        jl.push_str(&line);
        jl.push('\n');
    }
    std::fs::write(a.out.join("results.jsonl"), jl)?;
    if let Some(s) = report::svg(
        &all,
        "sweep-lat",
        "Echo round trip p50 vs payload size",
        "µs",
        |r| r.p50_us,
    )? {
        std::fs::write(a.out.join("latency.svg"), s)?;
    }
    if let Some(s) = report::svg(
        &all,
        "sweep-bw",
        "Sink bandwidth (OSU window) vs payload size",
        "MB/s",
        |r| r.mb_s,
    )? {
        std::fs::write(a.out.join("bandwidth.svg"), s)?;
    }
    println!(
        "\nwrote {} records to {} (results.jsonl, latency.svg, bandwidth.svg) in {:.1} s",
        all.len(),
        a.out.display(),
        started.elapsed().as_secs_f64()
    );
    if mode == Mode::Smoke {
        for m in missing(&plan, &served, &all) {
            failures.push(format!("{m}: no record"));
        }
        if failures.is_empty() {
            println!(
                "smoke: every benchmark left its record over {}",
                served
                    .iter()
                    .map(|t| t.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    if !failures.is_empty() {
        return Err(format!(
            "{} run(s) failed:\n  {}",
            failures.len(),
            failures.join("\n  ")
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(bench: &str, t: &str) -> Record {
        Record {
            bench: bench.into(),
            transport: t.into(),
            payload: "1 buffer".into(),
            bytes: 1,
            window: 1,
            topology: "1x1".into(),
            calls: 1,
            p50_us: 1.0,
            p99_us: 1.0,
            p999_us: 1.0,
            mean_us: 1.0,
            mb_s: 1.0,
            rpc_s: 1.0,
            client_rss_kib: 0,
            server_rss_kib: 0,
            round: None,
        }
    }

    #[test]
    fn smoke_plan_covers_every_bench_and_ps_step_only_where_the_ps_serves() {
        let p = plan(&[], Mode::Smoke, 1024);
        let kinds: Vec<&str> = p.iter().map(|(b, _)| *b).collect();
        assert_eq!(
            kinds,
            [
                "latency",
                "bw",
                "bibw",
                "ps-throughput",
                "tensor",
                "sweep",
                "ps-step"
            ]
        );
        let ts = [Transport::IbexShm, Transport::RawTcp];
        let mut have: Vec<Record> = Vec::new();
        for t in ["ibex-shm", "raw-tcp"] {
            for b in [
                "latency",
                "bw",
                "bibw",
                "ps-throughput",
                "tensor",
                "sweep-lat",
                "sweep-bw",
            ] {
                have.push(rec(b, t));
            }
        }
        have.push(rec("memcpy", "local"));
        have.push(rec("floor", "local"));
        assert_eq!(missing(&p, &ts, &have), ["ibex-shm: ps-step"]);
        have.push(rec("ps-step", "ibex-shm"));
        assert!(missing(&p, &ts, &have).is_empty());
        have.retain(|r| !(r.bench == "sweep-bw" && r.transport == "raw-tcp"));
        assert_eq!(missing(&p, &ts, &have), ["raw-tcp: sweep-bw"]);
    }

    #[test]
    fn quick_plan_runs_ps_step_resnet50_2x2() {
        let p = plan(&["ps-step".into()], Mode::Quick, 1024);
        assert_eq!(p.len(), 1);
        assert!(
            p[0].1
                .join(" ")
                .contains("--model resnet50 --workers 2 --ps 2 --quick")
        );
    }
}
