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
        "bench", "transport", "payload", "#bytes", "win", "topo", "#calls", "p50 µs", "p99 µs", "p99.9 µs", "mean µs", "MB/s", "RPC/s", "cRSS MiB", "sRSS MiB"
    )
}

/// One human-readable table row.
pub fn row(r: &Record) -> String {
    format!(
        "{:<13} {:<10} {:<18} {:>7} {:>4} {:>5} {:>9} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>10.1} {:>10.0} {:>8.1} {:>8.1}",
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
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0 { ru.ru_maxrss.max(0) as u64 } else { 0 }
}

/// Peak RSS of another local process, KiB (`VmHWM` in /proc/<pid>/status); 0 if unknown.
pub fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// How a bench's figure of merit compares: the key that pairs records across transports,
/// the value, and whether higher is better.
fn merit(r: &Record) -> (String, f64, bool, &'static str) {
    let key = format!("{} {} {} w{} {}", r.bench, r.payload, r.bytes, r.window, r.topology);
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
    let _ = writeln!(out, "\nratios against stock tonic (same run; > 1 means better than tonic):");
    let _ = writeln!(out, "{:<13} {:<18} {:>7} {:>4} {:>5} {:<10} {:>10} {:>12} {:>8}", "bench", "payload", "#bytes", "win", "topo", "transport", "merit", "value", "x tonic");
    for r in records {
        if r.transport == "tonic" {
            continue;
        }
        let (key, v, higher, what) = merit(r);
        let Some(base) = records.iter().find(|b| b.transport == "tonic" && merit(b).0 == key) else { continue };
        let b = merit(base).1;
        // A point where no call finished in the measured time has no rate to compare.
        if r.calls == 0 || base.calls == 0 {
            let _ = writeln!(out, "{:<13} {:<18} {:>7} {:>4} {:>5} {:<10} {:>10} {:>12} {:>8}", r.bench, r.payload, fmt_size(r.bytes), r.window, r.topology, r.transport, what, "-", "no calls");
            continue;
        }
        let x = if higher { v / b } else { b / v };
        let _ = writeln!(out, "{:<13} {:<18} {:>7} {:>4} {:>5} {:<10} {:>10} {:>12.2} {:>8.2}", r.bench, r.payload, fmt_size(r.bytes), r.window, r.topology, r.transport, what, v, x);
    }
    out
}

/// The issue's performance bars, judged on this run's records. Informational: timings on a
/// shared machine vary, so nothing fails on them.
pub fn bars(records: &[Record]) -> String {
    let find = |bench: &str, t: &str, pred: &dyn Fn(&Record) -> bool| records.iter().find(|r| r.bench == bench && r.transport == t && pred(r));
    let mut out = String::from("\nperformance bars (this run):\n");
    let mut bar = |name: &str, got: Option<f64>, need: f64, unit: &str| {
        let line = match got {
            Some(g) => format!("  [{}] {name}: {g:.2}{unit} (bar {need}{unit})\n", if g >= need { "met " } else { "MISS" }),
            None => format!("  [n/a ] {name}: not measured in this run\n"),
        };
        out.push_str(&line);
    };
    let lat64 = |t: &str| find("latency", t, &|r| r.bytes == 64).map(|r| r.p50_us);
    bar("P2P latency 64 B, tonic p50 / ibex-shm p50", lat64("tonic").zip(lat64("ibex-shm")).map(|(a, b)| a / b), 10.0, "x");
    let skew = |t: &str| find("bw", t, &|r| r.payload.starts_with("skew") && r.window == 1).map(|r| r.mb_s);
    bar("P2P bandwidth skew, ibex-shm / tonic", skew("ibex-shm").zip(skew("tonic")).map(|(a, b)| a / b), 1.5, "x");
    let tensor = |t: &str| find("tensor", t, &|_| true).map(|r| r.mb_s);
    bar("tensor 16 MiB, ibex-shm registered / tonic Sink", tensor("ibex-shm").zip(tensor("tonic")).map(|(a, b)| a / b), 4.0, "x");
    let memcpy = records.iter().find(|r| r.bench == "memcpy").map(|r| r.mb_s);
    bar("tensor 16 MiB, ibex-shm registered / memcpy", tensor("ibex-shm").zip(memcpy).map(|(a, b)| a / b), 0.5, "x");
    let ps = |t: &str| find("ps-throughput", t, &|r| r.payload.starts_with("uniform/small")).map(|r| r.rpc_s);
    bar("PS throughput uniform small, ibex-shm / tonic RPC/s", ps("ibex-shm").zip(ps("tonic")).map(|(a, b)| a / b), 4.0, "x");
    let big = |t: &str| find("bw", t, &|r| r.bytes == 16 << 20 && r.payload == "1 buffer").map(|r| r.mb_s);
    bar("large payload 16 MiB Sink, ibex-tcp / tonic", big("ibex-tcp").zip(big("tonic")).map(|(a, b)| a / b), 1.5, "x");
    let step = |t: &str| find("ps-step", t, &|r| r.payload == "resnet50" && r.topology == "2x2").map(|r| r.rpc_s);
    bar("ps-step resnet50 2x2, ibex-shm / tonic steps/s", step("ibex-shm").zip(step("tonic")).map(|(a, b)| a / b), 3.0, "x");
    let cost = lat64("ibex-shm").zip(lat64("raw-shm")).map(|(g, r)| 3.0 - (g - r));
    bar("gRPC layer cost 64 B: 3 µs - (ibex-shm p50 - raw-shm p50), headroom", cost, 0.0, " µs");
    out
}

/// An SVG plot of `value` against payload size, log-log, one line per transport. Written by
/// hand: no font files or system libraries are needed to produce or view it.
pub fn svg(records: &[Record], bench: &str, title: &str, unit: &str, value: fn(&Record) -> f64) -> Option<String> {
    let pts: Vec<&Record> = records.iter().filter(|r| r.bench == bench && value(r) > 0.0).collect();
    if pts.is_empty() {
        return None;
    }
    let mut names: Vec<&str> = Vec::new();
    for r in &pts {
        if !names.contains(&r.transport.as_str()) {
            names.push(&r.transport);
        }
    }
    let (w, h, l, rgt, top, bot) = (900.0, 520.0, 80.0, 170.0, 40.0, 60.0);
    let lx = |b: usize| (b.max(1) as f64).log2();
    let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), r| (a.min(lx(r.bytes)), b.max(lx(r.bytes))));
    let (y0, y1) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), r| (a.min(value(r).log10()), b.max(value(r).log10())));
    let (y0, y1) = (y0.floor(), y1.ceil().max(y0.floor() + 1.0));
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - rgt);
    let py = |y: f64| top + (y1 - y) / (y1 - y0) * (h - top - bot);
    let mut s = String::new();
    let _ = writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#);
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="24" font-size="16" text-anchor="middle">{title}</text>"#, w / 2.0);
    for d in (y0 as i32)..=(y1 as i32) {
        let y = py(d as f64);
        let _ = writeln!(s, r##"<line x1="{l}" x2="{}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">1e{d}</text>"##, w - rgt, l - 6.0, y + 4.0);
    }
    let mut e = x0.ceil() as i32;
    while e as f64 <= x1 {
        let x = px(e as f64);
        let _ = writeln!(s, r##"<line x1="{x}" x2="{x}" y1="{top}" y2="{}" stroke="#eee"/><text x="{x}" y="{}" text-anchor="middle">{}</text>"##, h - bot, h - bot + 16.0, fmt_size(1usize << e));
        e += if x1 - x0 > 14.0 { 2 } else { 1 };
    }
    let _ = writeln!(s, r#"<text x="{}" y="{}" text-anchor="middle">payload bytes (log2)</text>"#, (l + w - rgt) / 2.0, h - 16.0);
    let _ = writeln!(s, r#"<text x="18" y="{}" transform="rotate(-90 18 {})" text-anchor="middle">{unit} (log10)</text>"#, h / 2.0, h / 2.0);
    const COLORS: [&str; 8] = ["#000000", "#7f7f7f", "#d62728", "#1f77b4", "#9467bd", "#ff7f0e", "#2ca02c", "#8c564b"];
    for (i, n) in names.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let mut line: Vec<(f64, f64)> = pts.iter().filter(|r| r.transport == *n).map(|r| (px(lx(r.bytes)), py(value(r).log10()))).collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = line.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(s, r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#, path.join(" "));
        for (x, y) in &line {
            let _ = writeln!(s, r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{c}"/>"#);
        }
        let ly = top + 10.0 + i as f64 * 18.0;
        let _ = writeln!(s, r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"/><text x="{}" y="{}">{n}</text>"#, w - rgt + 12.0, w - rgt + 36.0, w - rgt + 42.0, ly + 4.0);
    }
    s.push_str("</svg>\n");
    Some(s)
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
        }
    }

    #[test]
    fn ratio_pairs_records_and_inverts_latency() {
        let rs = vec![rec("latency", "tonic", 64, 30.0, 1.0), rec("latency", "ibex-shm", 64, 3.0, 1.0), rec("bw", "tonic", 64, 1.0, 100.0), rec("bw", "ibex-shm", 64, 1.0, 250.0)];
        let t = ratios(&rs);
        assert!(t.lines().any(|l| l.starts_with("latency") && l.trim_end().ends_with("10.00")), "{t}");
        assert!(t.lines().any(|l| l.starts_with("bw") && l.trim_end().ends_with("2.50")), "{t}");
        assert!(bars(&rs).contains("[met ] P2P latency 64 B"));
    }

    #[test]
    fn svg_has_one_line_per_transport_and_round_trips_json() {
        let rs = vec![rec("sweep-lat", "tonic", 1, 30.0, 1.0), rec("sweep-lat", "tonic", 1024, 40.0, 1.0), rec("sweep-lat", "ibex-shm", 1, 3.0, 1.0)];
        let s = svg(&rs, "sweep-lat", "t", "µs", |r| r.p50_us).expect("points");
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(svg(&rs, "sweep-bw", "t", "MB/s", |r| r.mb_s).is_none());
        let line = serde_json::to_string(&rs[0]).expect("json");
        let back: Record = serde_json::from_str(&line).expect("parse");
        assert_eq!(back.bytes, 1);
    }
}
