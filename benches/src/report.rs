//! Results: the record every benchmark produces, perftest-like tables, JSON lines, ratio
//! tables against stock tonic, and the SVG plots.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// One measured point. Serialized as one JSON line.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// `latency`, `bw`, `bibw`, `ps-throughput`, `sweep-lat`, `sweep-bw`, `tensor`, `memcpy`,
    /// `ps-step` (there: `calls` = measured steps, `rpc_s` = steps/s, percentiles per step,
    /// `mb_s` = every worker's pulled variables plus pushed gradients per second, `bytes` =
    /// the model's f32 bytes, `payload` = the model).
    pub bench: String,
    /// Transport name (`tonic`, `ibex-shm`, ...).
    pub transport: String,
    /// Payload label (`skew x10`, `1 buffer`, ...).
    pub payload: String,
    /// Payload bytes per call, one direction.
    pub bytes: usize,
    /// Calls outstanding per connection.
    pub window: usize,
    /// Workers x servers for `ps-throughput`, 1x1 otherwise.
    pub topology: String,
    /// Calls completed in the measured time (all runs).
    pub calls: u64,
    /// Round-trip percentiles and mean, µs (per call, as the caller sees it).
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
    /// Payload MB/s (10^6 bytes), both directions counted for `bibw`.
    pub mb_s: f64,
    /// Calls per second.
    pub rpc_s: f64,
    /// Peak RSS of the client process, KiB (getrusage).
    pub client_rss_kib: u64,
    /// Peak RSS of the server process(es), KiB (VmHWM; 0 when the server is remote).
    pub server_rss_kib: u64,
    /// `compare`'s alternating round that measured it (see [`ROUND_TRANSPORTS`]); none for
    /// the main run's points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u32>,
}

fn fmt_size(s: usize) -> String {
    if s >= 1 << 20 && s.is_multiple_of(1 << 20) {
        format!("{}M", s >> 20)
    } else if s >= 1 << 10 && s.is_multiple_of(1 << 10) {
        format!("{}K", s >> 10)
    } else {
        format!("{s}")
    }
}

/// The table header matching [`row`].
pub fn header() -> String {
    format!(
        "{:<13} {:<10} {:<18} {:>7} {:>4} {:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>10} {:>8} {:>8}",
        "bench",
        "transport",
        "payload",
        "#bytes",
        "win",
        "topo",
        "#calls",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "mean µs",
        "MB/s",
        "RPC/s",
        "cRSS MiB",
        "sRSS MiB"
    )
}

/// One human-readable table row.
pub fn row(r: &Record) -> String {
    format!(
        "{:<13} {:<10} {:<18} {:>7} {:>4} {:>5} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.1} {:>10.*} {:>8.1} {:>8.1}",
        r.bench,
        r.transport,
        r.payload,
        fmt_size(r.bytes),
        r.window,
        r.topology,
        r.calls,
        r.p50_us,
        r.p99_us,
        r.p999_us,
        r.mean_us,
        r.mb_s,
        // ps-step's steps/s are small numbers.
        if r.rpc_s < 100.0 { 2 } else { 0 },
        r.rpc_s,
        r.client_rss_kib as f64 / 1024.0,
        r.server_rss_kib as f64 / 1024.0
    )
}

/// Peak RSS of this process, KiB.
pub fn self_peak_rss_kib() -> u64 {
    // SAFETY: getrusage only writes the struct we pass; zeroed is a valid `rusage`.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0 {
        ru.ru_maxrss.max(0) as u64
    } else {
        0
    }
}

/// Peak RSS of another local process, KiB (`VmHWM` in /proc/<pid>/status); 0 if unknown.
pub fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// How a bench's figure of merit compares: the key that pairs records across transports,
/// the value, and whether higher is better.
fn merit(r: &Record) -> (String, f64, bool, &'static str) {
    let key = format!(
        "{} {} {} w{} {}",
        r.bench, r.payload, r.bytes, r.window, r.topology
    );
    match r.bench.as_str() {
        "latency" | "sweep-lat" => (key, r.p50_us, false, "p50 lower"),
        "ps-throughput" => (key, r.rpc_s, true, "RPC/s"),
        "ps-step" => (key, r.rpc_s, true, "steps/s"),
        _ => (key, r.mb_s, true, "MB/s"),
    }
}

/// The ratio table: every record against the stock-tonic record of the same bench and
/// payload. `x` is always "times better than stock tonic".
pub fn ratios(records: &[Record]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nratios against stock tonic (same run; > 1 means better than tonic):"
    );
    let _ = writeln!(
        out,
        "{:<13} {:<18} {:>7} {:>4} {:>5} {:<10} {:>10} {:>12} {:>8}",
        "bench", "payload", "#bytes", "win", "topo", "transport", "merit", "value", "x tonic"
    );
    for r in records {
        if r.transport == "tonic" {
            continue;
        }
        let (key, v, higher, what) = merit(r);
        let Some(base) = records
            .iter()
            .find(|b| b.transport == "tonic" && merit(b).0 == key)
        else {
            continue;
        };
        let b = merit(base).1;
        // A point where no call finished in the measured time has no rate to compare.
        if r.calls == 0 || base.calls == 0 {
            let _ = writeln!(
                out,
                "{:<13} {:<18} {:>7} {:>4} {:>5} {:<10} {:>10} {:>12} {:>8}",
                r.bench,
                r.payload,
                fmt_size(r.bytes),
                r.window,
                r.topology,
                r.transport,
                what,
                "-",
                "no calls"
            );
            continue;
        }
        let x = if higher { v / b } else { b / v };
        let _ = writeln!(
            out,
            "{:<13} {:<18} {:>7} {:>4} {:>5} {:<10} {:>10} {:>12.2} {:>8.2}",
            r.bench,
            r.payload,
            fmt_size(r.bytes),
            r.window,
            r.topology,
            r.transport,
            what,
            v,
            x
        );
    }
    out
}

/// The transports the call path's bars compare point by point. `compare` measures their
/// 64 B Echo and small PS throughput again in alternating rounds, fresh servers each round,
/// and those bars are judged on each point's median over the rounds: on a shared machine two runs
/// minutes apart differ by more than the bars' margins, two runs seconds apart much less.
pub const ROUND_TRANSPORTS: [&str; 7] = [
    "tonic",
    "ibex-shm",
    "ibex-shm-busy",
    "raw-shm",
    "ibex-tcp",
    "raw-tcp",
    "raw-shm-types",
];

/// The transports whose 64 B latency `compare`'s rounds judge against a spinning floor
/// measured just before it, in the same round (the busy-polling bar).
pub const FLOOR_BESIDE: [&str; 1] = ["ibex-shm-busy"];

/// The payload label of a floor measured just before `transport`'s latency point.
pub fn beside(how: &str, transport: &str) -> String {
    format!("{how}, beside {transport}")
}

/// The records of one run or one round, with the points the bars read.
struct View<'a>(Vec<&'a Record>);

impl View<'_> {
    fn find(&self, bench: &str, t: &str, pred: impl Fn(&Record) -> bool) -> Option<&Record> {
        self.0
            .iter()
            .copied()
            .find(|r| r.bench == bench && r.transport == t && pred(r))
    }
    fn lat64(&self, t: &str) -> Option<f64> {
        self.find("latency", t, |r| r.bytes == 64).map(|r| r.p50_us)
    }
    fn p99(&self, t: &str) -> Option<f64> {
        self.find("latency", t, |r| r.bytes == 64).map(|r| r.p99_us)
    }
    fn ps(&self, t: &str) -> Option<f64> {
        self.find("ps-throughput", t, |r| {
            r.payload.starts_with("uniform/small")
        })
        .map(|r| r.rpc_s)
    }
    fn floor(&self, how: &str) -> Option<f64> {
        self.0
            .iter()
            .find(|r| r.bench == "floor" && r.payload == how)
            .map(|r| r.p50_us)
    }
    /// The floor measured just before `t`'s latency point where there is one, else the
    /// run's or round's own.
    fn floor_beside(&self, how: &str, t: &str) -> Option<f64> {
        self.floor(&beside(how, t)).or_else(|| self.floor(how))
    }
    fn skew(&self, t: &str) -> Option<f64> {
        self.find("bw", t, |r| r.payload.starts_with("skew") && r.window == 1)
            .map(|r| r.mb_s)
    }
    fn tensor(&self, t: &str) -> Option<f64> {
        self.find("tensor", t, |_| true).map(|r| r.mb_s)
    }
    fn memcpy(&self) -> Option<f64> {
        self.0.iter().find(|r| r.bench == "memcpy").map(|r| r.mb_s)
    }
    fn big(&self, t: &str) -> Option<f64> {
        self.find("bw", t, |r| r.bytes == 16 << 20 && r.payload == "1 buffer")
            .map(|r| r.mb_s)
    }
    fn step(&self, t: &str) -> Option<f64> {
        self.step_record(t).map(|r| r.rpc_s)
    }
    /// Effective MB/s of the ResNet-50 2x2 step.
    fn step_mb(&self, t: &str) -> Option<f64> {
        self.step_record(t).map(|r| r.mb_s)
    }
    fn step_record(&self, t: &str) -> Option<&Record> {
        self.find("ps-step", t, |r| {
            r.payload == "resnet50" && r.topology == "2x2"
        })
    }
    /// The plain TCP stream measured beside ibex-tcp's step.
    fn tcp_stream(&self) -> Option<f64> {
        self.0
            .iter()
            .find(|r| r.bench == "tcp-stream")
            .map(|r| r.mb_s)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Every point the rounds measured as one record: its figures' medians over the rounds
/// that measured it.
fn medians(rounds: &[View]) -> Vec<Record> {
    let mut groups: Vec<(String, Vec<&Record>)> = Vec::new();
    for r in rounds.iter().flat_map(|v| v.0.iter().copied()) {
        let key = format!("{} {}", r.transport, merit(r).0);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    groups
        .into_iter()
        .map(|(_, g)| {
            let m = |f: fn(&Record) -> f64| median(&mut g.iter().map(|r| f(r)).collect::<Vec<_>>());
            Record {
                p50_us: m(|r| r.p50_us),
                p99_us: m(|r| r.p99_us),
                p999_us: m(|r| r.p999_us),
                mean_us: m(|r| r.mean_us),
                mb_s: m(|r| r.mb_s),
                rpc_s: m(|r| r.rpc_s),
                round: None,
                ..g[0].clone()
            }
        })
        .collect()
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.zip(b).map(|(a, b)| a / b)
}

/// The performance bars, judged on this run's records: where `compare`'s
/// alternating rounds measured a bar's points, on each point's median over the rounds (with
/// the range of the per-round values), else the main run's points. Informational: timings on a shared machine
/// vary, so nothing fails on them.
pub fn bars(records: &[Record]) -> String {
    let main = View(records.iter().filter(|r| r.round.is_none()).collect());
    let mut by_round = std::collections::BTreeMap::<u32, Vec<&Record>>::new();
    for r in records {
        if let Some(n) = r.round {
            by_round.entry(n).or_default().push(r);
        }
    }
    let rounds: Vec<View> = by_round.into_values().map(View).collect();
    let medians = medians(&rounds);
    let median_view = View(medians.iter().collect());
    let mut out = if rounds.is_empty() {
        String::from("\nperformance bars (this run):\n")
    } else {
        format!(
            "\nperformance bars (this run; [{n}/lo-hi]: judged on each point's median over {n} alternating rounds, lo-hi the per-round values):\n",
            n = rounds.len()
        )
    };
    // A figure, and the range of its per-round values where the rounds measured it.
    let measure = |f: &dyn Fn(&View) -> Option<f64>| {
        let mut per: Vec<f64> = rounds.iter().filter_map(f).collect();
        per.sort_by(f64::total_cmp);
        // The median of each side, not of the per-round ratios: a point that reads slow
        // now and then (a side asleep) then moves one side's median a little instead of
        // making that round's ratio an outlier.
        match f(&median_view) {
            Some(g) if !per.is_empty() => (
                Some(g),
                format!(" [{}/{:.2}-{:.2}]", per.len(), per[0], per[per.len() - 1]),
            ),
            _ => (f(&main), String::new()),
        }
    };
    // A ratio of two points measured one right after the other in each round: the median
    // of the per-round ratios. The median of each side would pair one round's floor with
    // another round's call, which on this machine can be four times apart in how fast the
    // two cores talk (see `FLOOR_BESIDE`).
    let paired = |f: &dyn Fn(&View) -> Option<f64>| {
        let mut per: Vec<f64> = rounds.iter().filter_map(f).collect();
        if per.is_empty() {
            return measure(f);
        }
        per.sort_by(f64::total_cmp);
        let spread = format!(
            " [{}/{:.2}-{:.2}, paired]",
            per.len(),
            per[0],
            per[per.len() - 1]
        );
        (Some(median(&mut per)), spread)
    };
    // `at_most`: the bar is an upper bound (a cost ratio), else a lower bound (a speed-up).
    // `pair`: judged on the per-round ratios (`paired`), else on each side's median.
    let mut judge = |name: &str,
                     f: &dyn Fn(&View) -> Option<f64>,
                     need: f64,
                     unit: &str,
                     at_most: bool,
                     pair: bool| {
        let (got, spread) = if pair { paired(f) } else { measure(f) };
        let line = match got {
            Some(g) => format!(
                "  [{}] {name}: {g:.2}{unit}{spread} (bar {} {need}{unit})\n",
                if (at_most && g <= need) || (!at_most && g >= need) {
                    "met "
                } else {
                    "MISS"
                },
                if at_most { "<=" } else { ">=" }
            ),
            None => format!("  [n/a ] {name}: not measured in this run\n"),
        };
        out.push_str(&line);
    };
    let mut bar = |name: &str, f: &dyn Fn(&View) -> Option<f64>, need: f64, unit: &str| {
        judge(name, f, need, unit, false, false)
    };
    bar(
        "P2P latency 64 B, tonic p50 / ibex-shm p50",
        &|v| ratio(v.lat64("tonic"), v.lat64("ibex-shm")),
        10.0,
        "x",
    );
    bar(
        "P2P bandwidth skew, ibex-shm / tonic",
        &|v| ratio(v.skew("ibex-shm"), v.skew("tonic")),
        1.5,
        "x",
    );
    bar(
        "tensor 16 MiB, ibex-shm registered / tonic Sink",
        &|v| ratio(v.tensor("ibex-shm"), v.tensor("tonic")),
        4.0,
        "x",
    );
    bar(
        "tensor 16 MiB, ibex-shm registered / memcpy",
        &|v| ratio(v.tensor("ibex-shm"), v.memcpy()),
        0.5,
        "x",
    );
    bar(
        "PS throughput uniform small, ibex-shm / tonic RPC/s",
        &|v| ratio(v.ps("ibex-shm"), v.ps("tonic")),
        4.0,
        "x",
    );
    bar(
        "large payload 16 MiB Sink, ibex-tcp / tonic",
        &|v| ratio(v.big("ibex-tcp"), v.big("tonic")),
        1.5,
        "x",
    );
    bar(
        "ps-step resnet50 2x2, ibex-shm / tonic steps/s",
        &|v| ratio(v.step("ibex-shm"), v.step("tonic")),
        3.0,
        "x",
    );
    bar(
        "ps-step resnet50 2x2, ibex-tcp / tonic steps/s",
        &|v| ratio(v.step("ibex-tcp"), v.step("tonic")),
        1.8,
        "x",
    );
    bar(
        "ps-step resnet50 2x2, ibex-tcp effective MB/s / one plain TCP stream",
        &|v| ratio(v.step_mb("ibex-tcp"), v.tcp_stream()),
        0.7,
        "x",
    );
    bar(
        "gRPC layer cost 64 B: 3 µs - (ibex-shm p50 - raw-shm p50), headroom",
        &|v| {
            v.lat64("ibex-shm")
                .zip(v.lat64("raw-shm"))
                .map(|(g, r)| 3.0 - (g - r))
        },
        0.0,
        " µs",
    );
    // The call path's bars: each transport against the layer below it and the floor.
    let mut at_most = |name: &str, f: &dyn Fn(&View) -> Option<f64>, need: f64, pair: bool| {
        judge(name, f, need, "x", true, pair)
    };
    at_most(
        "64 B p50, ibex-shm / raw-shm",
        &|v| ratio(v.lat64("ibex-shm"), v.lat64("raw-shm")),
        1.3,
        false,
    );
    at_most(
        "64 B p50, raw-shm / futex floor",
        &|v| ratio(v.lat64("raw-shm"), v.floor("futex")),
        1.3,
        false,
    );
    at_most(
        "64 B p50, ibex-tcp / raw-tcp",
        &|v| ratio(v.lat64("ibex-tcp"), v.lat64("raw-tcp")),
        1.3,
        false,
    );
    at_most(
        "64 B p50 busy-polling, ibex-shm-busy / spin floor measured beside it",
        &|v| {
            ratio(
                v.lat64("ibex-shm-busy"),
                v.floor_beside("spin", "ibex-shm-busy"),
            )
        },
        20.0,
        true,
    );
    at_most(
        "64 B p99, ibex-shm-busy / ibex-shm (busy p99 stays below default)",
        &|v| ratio(v.p99("ibex-shm-busy"), v.p99("ibex-shm")),
        1.0,
        false,
    );
    let mut at_least = |name: &str, f: &dyn Fn(&View) -> Option<f64>, need: f64| {
        judge(name, f, need, "x", false, false)
    };
    at_least(
        "64 B p50, tonic / ibex-shm",
        &|v| ratio(v.lat64("tonic"), v.lat64("ibex-shm")),
        5.0,
    );
    at_least(
        "64 B p50 busy-polling, tonic / ibex-shm-busy",
        &|v| ratio(v.lat64("tonic"), v.lat64("ibex-shm-busy")),
        20.0,
    );
    at_least(
        "PS throughput uniform small, ibex-shm / raw-shm RPC/s",
        &|v| ratio(v.ps("ibex-shm"), v.ps("raw-shm")),
        0.6,
    );
    // Where ibex-shm stands against the least any layer that hands tonic's types to its
    // handlers and callers can cost (`raw-shm-types`): what is left above it is our call
    // framing. No bar.
    type Ratio<'a> = &'a dyn Fn(&View) -> Option<f64>;
    let lines: [(&str, Ratio); 3] = [
        (
            "64 B p50, raw-shm-types / raw-shm (tonic's types and protobuf, no framing)",
            &|v| ratio(v.lat64("raw-shm-types"), v.lat64("raw-shm")),
        ),
        (
            "64 B p50, ibex-shm / raw-shm-types (the call framing)",
            &|v| ratio(v.lat64("ibex-shm"), v.lat64("raw-shm-types")),
        ),
        (
            "PS throughput uniform small, ibex-shm / raw-shm-types RPC/s",
            &|v| ratio(v.ps("ibex-shm"), v.ps("raw-shm-types")),
        ),
    ];
    // The busy-polling bar judged the other way, for comparison: each side's median, with
    // the floor measured at each round's start.
    let (g, spread) = measure(&|v| ratio(v.lat64("ibex-shm-busy"), v.floor("spin")));
    if let Some(g) = g {
        out.push_str(&format!(
            "  [info] 64 B p50 busy-polling, ibex-shm-busy / the round's first spin floor, each side's median: {g:.2}x{spread}\n"
        ));
    }
    out.push_str("\nthe floor of a tonic-compatible layer over shm (no bar):\n");
    for (name, f) in lines {
        out.push_str(&match measure(f) {
            (Some(g), spread) => format!("  [info] {name}: {g:.2}x{spread}\n"),
            (None, _) => format!("  [n/a ] {name}: not measured in this run\n"),
        });
    }
    out
}

/// An SVG plot of `value` against payload size, log-log, one line per transport, drawn with
/// plotters' SVG backend. Without plotters' `ttf` feature its text layout is estimated
/// (`naive` font metrics) and the text goes into the SVG as `<text>` for the viewer to
/// render, so no font files or system libraries are needed to produce it.
pub fn svg(
    records: &[Record],
    bench: &str,
    title: &str,
    unit: &str,
    value: fn(&Record) -> f64,
) -> crate::Res<Option<String>> {
    use plotters::prelude::*;

    let pts: Vec<&Record> = records
        .iter()
        .filter(|r| r.bench == bench && value(r) > 0.0)
        .collect();
    if pts.is_empty() {
        return Ok(None);
    }
    let mut names: Vec<&str> = Vec::new();
    for r in &pts {
        if !names.contains(&r.transport.as_str()) {
            names.push(&r.transport);
        }
    }
    let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), r| {
        (a.min(r.bytes.max(1) as f64), b.max(r.bytes.max(1) as f64))
    });
    let x1 = if x1 > x0 { x1 } else { x0 * 2.0 };
    let (y0, y1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), r| {
        (a.min(value(r)), b.max(value(r)))
    });
    // Whole decades, so the axis starts and ends on labelled lines.
    let (y0, y1) = (
        10f64.powf(y0.log10().floor()),
        10f64.powf(y1.log10().ceil().max(y0.log10().floor() + 1.0)),
    );
    const COLORS: [RGBColor; 8] = [
        RGBColor(0, 0, 0),
        RGBColor(127, 127, 127),
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(140, 86, 75),
    ];
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 520)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(72)
            .build_cartesian_2d((x0..x1).log_scale().base(2.0), (y0..y1).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("payload bytes")
            .y_desc(unit)
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .x_labels(14)
            .x_label_formatter(&|x| fmt_size(x.round() as usize))
            .y_label_formatter(&|y| format!("{y}"))
            .draw()?;
        for (i, n) in names.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            let mut line: Vec<(f64, f64)> = pts
                .iter()
                .filter(|r| r.transport == *n)
                .map(|r| (r.bytes.max(1) as f64, value(r)))
                .collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(line.iter().copied(), c.stroke_width(2)))?
                .label(*n)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
            chart.draw_series(line.iter().map(|&p| Circle::new(p, 3, c.filled())))?;
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 15))
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(bench: &str, t: &str, bytes: usize, p50: f64, mb: f64) -> Record {
        Record {
            bench: bench.into(),
            transport: t.into(),
            payload: "1 buffer".into(),
            bytes,
            window: 1,
            topology: "1x1".into(),
            calls: 10,
            p50_us: p50,
            p99_us: p50,
            p999_us: p50,
            mean_us: p50,
            mb_s: mb,
            rpc_s: 1.0,
            client_rss_kib: 0,
            server_rss_kib: 0,
            round: None,
        }
    }

    #[test]
    fn the_tcp_step_is_judged_against_tonic_and_the_plain_stream() {
        let step = |t: &str, steps: f64, mb: f64| Record {
            payload: "resnet50".into(),
            topology: "2x2".into(),
            rpc_s: steps,
            ..rec("ps-step", t, 102 << 20, 1.0, mb)
        };
        let rs = vec![
            step("tonic", 2.0, 800.0),
            step("ibex-tcp", 4.0, 1600.0),
            rec("tcp-stream", "local", 1 << 20, 1.0, 2000.0),
        ];
        let b = bars(&rs);
        assert!(
            b.contains("[met ] ps-step resnet50 2x2, ibex-tcp / tonic steps/s: 2.00x"),
            "{b}"
        );
        assert!(
            b.contains(
                "[met ] ps-step resnet50 2x2, ibex-tcp effective MB/s / one plain TCP stream: 0.80x"
            ),
            "{b}"
        );
    }

    #[test]
    fn ratio_pairs_records_and_inverts_latency() {
        let rs = vec![
            rec("latency", "tonic", 64, 30.0, 1.0),
            rec("latency", "ibex-shm", 64, 3.0, 1.0),
            rec("bw", "tonic", 64, 1.0, 100.0),
            rec("bw", "ibex-shm", 64, 1.0, 250.0),
        ];
        let t = ratios(&rs);
        assert!(
            t.lines()
                .any(|l| l.starts_with("latency") && l.trim_end().ends_with("10.00")),
            "{t}"
        );
        assert!(
            t.lines()
                .any(|l| l.starts_with("bw") && l.trim_end().ends_with("2.50")),
            "{t}"
        );
        assert!(bars(&rs).contains("[met ] P2P latency 64 B"));
    }

    #[test]
    fn call_path_bars_take_the_median_of_the_rounds_and_others_the_main_run() {
        let round = |n: u32, t: &str, p50: f64| Record {
            round: Some(n),
            ..rec("latency", t, 64, p50, 1.0)
        };
        let rs = vec![
            // The main run alone would miss the bar (3.0x)...
            rec("latency", "ibex-shm", 64, 12.0, 1.0),
            rec("latency", "raw-shm", 64, 4.0, 1.0),
            rec("bw", "tonic", 64, 1.0, 100.0),
            rec("bw", "ibex-tcp", 16 << 20, 1.0, 1.0),
            // ...three rounds read 1.1x, 0.5x (raw-shm slow once: a side asleep) and 1.2x.
            // Judged on the medians of the sides, 6.0 and 5.0 us: 1.2x, not the 1.1x
            // median of the per-round ratios, which the slow round pulls down.
            round(1, "ibex-shm", 4.4),
            round(1, "raw-shm", 4.0),
            round(2, "ibex-shm", 6.0),
            round(2, "raw-shm", 12.0),
            round(3, "ibex-shm", 6.0),
            round(3, "raw-shm", 5.0),
        ];
        let b = bars(&rs);
        assert!(
            b.contains("[met ] 64 B p50, ibex-shm / raw-shm: 1.20x [3/0.50-1.20] (bar <= 1.3x)"),
            "{b}"
        );
        // No round measured tonic's latency, nor the main run: not measured.
        assert!(
            b.contains("[n/a ] P2P latency 64 B, tonic p50 / ibex-shm p50"),
            "{b}"
        );
        // Bars the rounds do not measure come from the main run, without a range.
        let main_only = vec![
            rec("latency", "ibex-shm", 64, 12.0, 1.0),
            rec("latency", "raw-shm", 64, 4.0, 1.0),
        ];
        let b = bars(&main_only);
        assert!(
            b.contains("[MISS] 64 B p50, ibex-shm / raw-shm: 3.00x (bar <= 1.3x)"),
            "{b}"
        );
        assert!(b.starts_with("\nperformance bars (this run):"), "{b}");
    }

    #[test]
    fn the_busy_bar_pairs_each_round_with_the_floor_measured_beside_it() {
        let round = |n: u32, t: &str, p50: f64| Record {
            round: Some(n),
            ..rec("latency", t, 64, p50, 1.0)
        };
        let floor = |n: u32, how: &str, p50: f64| Record {
            payload: how.into(),
            round: Some(n),
            ..rec("floor", "local", 64, p50, 0.0)
        };
        let beside_busy = beside("spin", "ibex-shm-busy");
        let rs = vec![
            // The machine's two states: the cores talk in 0.1 or 0.5 us. Each round's first
            // floor and its busy point saw different states in rounds 1 and 2.
            floor(1, "spin", 0.1),
            floor(1, &beside_busy, 0.5),
            round(1, "ibex-shm-busy", 2.5),
            floor(2, "spin", 0.1),
            floor(2, &beside_busy, 0.5),
            round(2, "ibex-shm-busy", 2.5),
            floor(3, "spin", 0.1),
            floor(3, &beside_busy, 0.1),
            round(3, "ibex-shm-busy", 1.8),
        ];
        let b = bars(&rs);
        // Per round: 5.0x, 5.0x, 18.0x; their median is judged.
        assert!(
            b.contains("[met ] 64 B p50 busy-polling, ibex-shm-busy / spin floor measured beside it: 5.00x [3/5.00-18.00, paired] (bar <= 20x)"),
            "{b}"
        );
        // Each side's median pairs a 0.1 us floor with a 2.5 us call: 25x.
        assert!(
            b.contains("[info] 64 B p50 busy-polling, ibex-shm-busy / the round's first spin floor, each side's median: 25.00x"),
            "{b}"
        );
        // Without a floor beside it (a main run, or rounds that measured none), the round's own.
        let main_only = vec![
            Record {
                payload: "spin".into(),
                ..rec("floor", "local", 64, 0.1, 0.0)
            },
            rec("latency", "ibex-shm-busy", 64, 1.8, 1.0),
        ];
        assert!(
            bars(&main_only).contains("[met ] 64 B p50 busy-polling, ibex-shm-busy / spin floor measured beside it: 18.00x (bar <= 20x)"),
            "{}",
            bars(&main_only)
        );
    }

    #[test]
    fn the_types_floor_splits_the_layer_and_judges_nothing() {
        let round = |n: u32, t: &str, p50: f64| Record {
            round: Some(n),
            ..rec("latency", t, 64, p50, 1.0)
        };
        let rs = vec![
            round(1, "raw-shm", 1.0),
            round(1, "raw-shm-types", 1.4),
            round(1, "ibex-shm", 2.1),
            round(2, "raw-shm", 2.0),
            round(2, "raw-shm-types", 2.4),
            round(2, "ibex-shm", 3.6),
        ];
        let b = bars(&rs);
        // Medians: raw 1.5, floor 1.9, ibex 2.85 us.
        assert!(
            b.contains("[info] 64 B p50, raw-shm-types / raw-shm (tonic's types and protobuf, no framing): 1.27x [2/1.20-1.40]"),
            "{b}"
        );
        assert!(
            b.contains(
                "[info] 64 B p50, ibex-shm / raw-shm-types (the call framing): 1.50x [2/1.50-1.50]"
            ),
            "{b}"
        );
        assert!(
            b.contains("[n/a ] PS throughput uniform small, ibex-shm / raw-shm-types RPC/s"),
            "{b}"
        );
        // It is no bar: the section judges nothing.
        let floor = &b[b
            .find("the floor of a tonic-compatible layer")
            .expect("section")..];
        assert!(
            !floor.contains("[met ]") && !floor.contains("[MISS]"),
            "{b}"
        );
    }

    #[test]
    fn svg_has_one_line_per_transport_and_round_trips_json() {
        let rs = vec![
            rec("sweep-lat", "tonic", 1, 30.0, 1.0),
            rec("sweep-lat", "tonic", 1024, 40.0, 1.0),
            rec("sweep-lat", "ibex-shm", 1, 3.0, 1.0),
        ];
        let s = svg(&rs, "sweep-lat", "Echo p50", "µs", |r| r.p50_us)
            .expect("plot")
            .expect("points");
        // One line per transport plus its legend swatch, one marker per point, labelled axes.
        assert_eq!(s.matches(r#"stroke-width="2" points"#).count(), 4, "{s}");
        assert_eq!(s.matches("<circle").count(), 3, "{s}");
        for text in ["Echo p50", "payload bytes", "µs", "tonic", "ibex-shm", "1K"] {
            assert!(
                s.lines().any(|l| l.trim() == text),
                "text {text:?} missing in {s}"
            );
        }
        assert!(
            svg(&rs, "sweep-bw", "t", "MB/s", |r| r.mb_s)
                .expect("plot")
                .is_none()
        );
        let line = serde_json::to_string(&rs[0]).expect("json");
        let back: Record = serde_json::from_str(&line).expect("parse");
        assert_eq!(back.bytes, 1);
    }
}
