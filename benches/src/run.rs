//! The measurement loop and the benchmarks built on it (the client side).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;

use crate::Res;
use crate::payload::{Msg, PayloadSpec};
use crate::report::{Record, self_peak_rss_kib};
use crate::server::{RAW_ECHO, RAW_SINK};
use crate::transport::{Client, Transport};

/// What one call does.
#[derive(Clone)]
pub enum Op {
    /// Echo: payload there and back.
    Echo(Arc<Msg>),
    /// Sink: payload there, a small acknowledgement back.
    Sink(Arc<Msg>),
    /// A registered tensor buffer by the transport's cheapest path.
    Tensor(Bytes),
}

impl Op {
    fn bytes(&self) -> usize {
        match self {
            Op::Echo(m) | Op::Sink(m) => m.bytes,
            Op::Tensor(b) => b.len(),
        }
    }
    async fn call(&self, c: &mut Client) -> Res<()> {
        let got = match self {
            Op::Echo(m) => c.echo(m).await?,
            Op::Sink(m) => c.sink(m).await?,
            Op::Tensor(b) => c.tensor(b).await?,
        };
        // The raw transport cannot send an empty message, so its payloads are at least 1 B.
        let want = if matches!(c, Client::Raw(_)) {
            self.bytes().max(1)
        } else {
            self.bytes()
        };
        if got != want {
            return Err(format!("server answered {got} bytes for a {want}-byte call: the peer is not an ibex-bench server of this version").into());
        }
        Ok(())
    }
}

/// Timing knobs of one measurement.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Unmeasured time first (connection set-up, caches, pools).
    pub warmup: Duration,
    /// Measured time per run.
    pub duration: Duration,
    /// Runs; the result sums calls and time over all of them (TF-gRPC-Bench: mean of 5).
    pub runs: usize,
}

/// Calls completed, time taken, per-call latency.
pub struct Sample {
    hist: Histogram<u64>,
    calls: u64,
    secs: f64,
}

fn new_hist() -> Res<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 120_000_000_000, 3)?)
}

/// Runs `op` in every group concurrently until time is up. A group is one logical caller
/// (one outstanding call slot, or one PS worker): each iteration it calls all its clients at
/// once and waits for all of them, and that iteration's time is one histogram sample.
pub async fn measure(groups: Vec<Vec<Client>>, op: Op, t: Timing) -> Res<Sample> {
    let mut total = Sample {
        hist: new_hist()?,
        calls: 0,
        secs: 0.0,
    };
    let mut groups = groups;
    // One call on every connection before the clock starts: a first call that outlasts the
    // warm-up (connection set-up, first large allocation on a loaded machine) would otherwise
    // leave the measured window without a single finished call.
    for g in &mut groups {
        for c in g.iter_mut() {
            op.call(c).await?;
        }
    }
    for run in 0..t.runs.max(1) {
        let warm = if run == 0 { t.warmup } else { Duration::ZERO };
        let start = Instant::now() + warm;
        let end = start + t.duration;
        let mut tasks = tokio::task::JoinSet::new();
        for mut g in groups.drain(..) {
            let op = op.clone();
            tasks.spawn(async move {
                let mut hist = new_hist()?;
                let mut calls = 0u64;
                loop {
                    let t0 = Instant::now();
                    if t0 >= end {
                        break;
                    }
                    if let [c] = g.as_mut_slice() {
                        // One client (latency, bandwidth): awaited in place, as a caller
                        // awaits its call. `join_all` would box every call's future (over
                        // 1.5 KiB, the largest client's) and poll it through two more
                        // layers on every spin step: harness cost in every transport's
                        // figure that the floor does not pay.
                        op.call(c).await?;
                    } else {
                        let results =
                            futures_util::future::join_all(g.iter_mut().map(|c| op.call(c))).await;
                        for r in results {
                            r?;
                        }
                    }
                    if t0 >= start {
                        hist.saturating_record(t0.elapsed().as_nanos() as u64);
                        calls += g.len() as u64;
                    }
                }
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>((g, hist, calls))
            });
        }
        let mut last_end = start;
        while let Some(r) = tasks.join_next().await {
            let (g, hist, calls) = r??;
            groups.push(g);
            total.hist.add(&hist)?;
            total.calls += calls;
            last_end = last_end.max(Instant::now());
        }
        // Calls in flight at the deadline finish late; count the time they took.
        total.secs += last_end.saturating_duration_since(start).as_secs_f64();
    }
    Ok(total)
}

/// Labels and shape of one record.
pub struct Shape<'a> {
    /// Bench name in the record.
    pub bench: &'a str,
    /// Transport.
    pub transport: Transport,
    /// Payload label.
    pub payload: String,
    /// Outstanding calls per connection.
    pub window: usize,
    /// `MxN`.
    pub topology: String,
    /// Payload bytes moved per call (2x the payload for bibw).
    pub bytes_per_call: usize,
    /// Payload bytes per call, one direction (for the table).
    pub bytes: usize,
}

/// Turns a sample into a record.
pub fn record(s: &Sample, shape: Shape<'_>) -> Record {
    let us = |q: f64| s.hist.value_at_quantile(q) as f64 / 1e3;
    let secs = s.secs.max(1e-9);
    Record {
        bench: shape.bench.into(),
        transport: shape.transport.name().into(),
        payload: shape.payload,
        bytes: shape.bytes,
        window: shape.window,
        topology: shape.topology,
        calls: s.calls,
        p50_us: us(0.5),
        p99_us: us(0.99),
        p999_us: us(0.999),
        mean_us: s.hist.mean() / 1e3,
        mb_s: s.calls as f64 * shape.bytes_per_call as f64 / secs / 1e6,
        rpc_s: s.calls as f64 / secs,
        client_rss_kib: self_peak_rss_kib(),
        server_rss_kib: 0,
        round: None,
    }
}

/// `window` clones of one connection: that many calls outstanding on it.
pub fn windowed(c: &Client, window: usize) -> Vec<Vec<Client>> {
    (0..window.max(1)).map(|_| vec![c.clone()]).collect()
}

/// The payload of a P2P bench: one buffer of `size` bytes if given, else the TF-gRPC-Bench
/// scheme.
pub fn p2p_msg(spec: &PayloadSpec, size: Option<usize>, echo: bool) -> (Arc<Msg>, String) {
    let tag = if echo { RAW_ECHO } else { RAW_SINK };
    match size {
        Some(s) => (Arc::new(Msg::new(&[s], tag)), "1 buffer".into()),
        None => (Arc::new(Msg::new(&spec.sizes(), tag)), spec.label()),
    }
}

/// The OSU window (64) capped so no more than 256 MiB are in flight at once: at 64 MiB
/// messages a 64-deep window would need 4 GiB on each side for no extra information.
pub fn osu_window(window: usize, size: usize) -> usize {
    window.min(((256usize << 20) / size.max(1)).max(1)).max(1)
}

/// Sizes of a sweep: powers of `step` from `min` to `max` inclusive.
pub fn sweep_sizes(min: usize, max: usize, step: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut s = min.max(1);
    while s <= max {
        v.push(s);
        s = match s.checked_mul(step.max(2)) {
            Some(n) => n,
            None => break,
        };
    }
    v
}

/// Single-thread memcpy of `size` bytes, MB/s: the ceiling for any copy-based path.
pub fn memcpy_mb_s(size: usize, t: Timing) -> f64 {
    let src = vec![7u8; size];
    let mut dst = vec![0u8; size];
    dst.copy_from_slice(&src);
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < t.duration.max(Duration::from_millis(50)) {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        n += 1;
    }
    n as f64 * size as f64 / start.elapsed().as_secs_f64() / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_is_powers_of_two_inclusive() {
        let s = sweep_sizes(1, 64 << 20, 2);
        assert_eq!(s.len(), 27);
        assert_eq!(s[0], 1);
        assert_eq!(*s.last().unwrap(), 64 << 20);
        assert_eq!(sweep_sizes(1, 4096, 16), vec![1, 16, 256, 4096]);
    }

    #[test]
    fn osu_window_caps_bytes_in_flight() {
        assert_eq!(osu_window(64, 64), 64);
        assert_eq!(osu_window(64, 64 << 20), 4);
        assert_eq!(osu_window(64, 1 << 30), 1);
    }
}
