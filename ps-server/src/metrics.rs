//! RPC counters and latency histograms, served in the Prometheus text format by a minimal
//! HTTP/1.1 responder (`GET /metrics`), so the PS needs no web framework.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::shard::Shard;

/// Latency bucket bounds, seconds.
const BUCKETS: [f64; 12] = [
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 1.0, 10.0,
];

#[derive(Default, Clone)]
pub(crate) struct Rpc {
    pub count: u64,
    pub errors: u64,
    pub seconds: f64,
    buckets: [u64; BUCKETS.len()],
}

/// Counters of one PS.
#[derive(Default)]
pub struct Metrics {
    rpcs: Mutex<BTreeMap<&'static str, Rpc>>,
    /// Gradient bytes received.
    pub bytes_pushed: AtomicU64,
    /// Value bytes sent.
    pub bytes_pulled: AtomicU64,
    /// Gradient bytes that arrived by one-sided reads instead of the body.
    pub bytes_remote: AtomicU64,
}

impl Metrics {
    pub(crate) fn observe(&self, method: &'static str, elapsed: Duration, ok: bool) {
        if let Ok(mut m) = self.rpcs.lock() {
            let r = m.entry(method).or_default();
            r.count += 1;
            r.errors += u64::from(!ok);
            let s = elapsed.as_secs_f64();
            r.seconds += s;
            for (b, n) in BUCKETS.iter().zip(r.buckets.iter_mut()) {
                if s <= *b {
                    *n += 1;
                }
            }
        }
    }

    pub(crate) fn snapshot(&self) -> BTreeMap<&'static str, Rpc> {
        self.rpcs.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// The Prometheus text exposition.
    pub fn render(&self, shard: &Shard) -> String {
        let mut o = String::new();
        let s = shard.cfg.shard;
        let _ = writeln!(
            o,
            "# HELP ibex_ps_step Steps applied on this shard.\n# TYPE ibex_ps_step gauge"
        );
        let _ = writeln!(o, "ibex_ps_step{{shard=\"{s}\"}} {}", shard.step());
        let _ = writeln!(
            o,
            "# HELP ibex_ps_variables Variables held.\n# TYPE ibex_ps_variables gauge"
        );
        let _ = writeln!(
            o,
            "ibex_ps_variables{{shard=\"{s}\"}} {}",
            shard.defs().len()
        );
        for (name, v) in [
            ("ibex_ps_bytes_pushed_total", &self.bytes_pushed),
            ("ibex_ps_bytes_pulled_total", &self.bytes_pulled),
            ("ibex_ps_bytes_remote_read_total", &self.bytes_remote),
        ] {
            let _ = writeln!(
                o,
                "# TYPE {name} counter\n{name}{{shard=\"{s}\"}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        let rpcs = self.snapshot();
        let _ = writeln!(
            o,
            "# HELP ibex_ps_rpcs_total RPCs served.\n# TYPE ibex_ps_rpcs_total counter"
        );
        for (m, r) in &rpcs {
            let _ = writeln!(
                o,
                "ibex_ps_rpcs_total{{shard=\"{s}\",method=\"{m}\"}} {}",
                r.count
            );
        }
        let _ = writeln!(
            o,
            "# HELP ibex_ps_rpc_errors_total RPCs that returned an error status.\n# TYPE ibex_ps_rpc_errors_total counter"
        );
        for (m, r) in &rpcs {
            let _ = writeln!(
                o,
                "ibex_ps_rpc_errors_total{{shard=\"{s}\",method=\"{m}\"}} {}",
                r.errors
            );
        }
        let _ = writeln!(
            o,
            "# HELP ibex_ps_rpc_seconds RPC latency.\n# TYPE ibex_ps_rpc_seconds histogram"
        );
        for (m, r) in &rpcs {
            for (b, n) in BUCKETS.iter().zip(r.buckets) {
                let _ = writeln!(
                    o,
                    "ibex_ps_rpc_seconds_bucket{{shard=\"{s}\",method=\"{m}\",le=\"{b}\"}} {n}"
                );
            }
            let _ = writeln!(
                o,
                "ibex_ps_rpc_seconds_bucket{{shard=\"{s}\",method=\"{m}\",le=\"+Inf\"}} {}",
                r.count
            );
            let _ = writeln!(
                o,
                "ibex_ps_rpc_seconds_sum{{shard=\"{s}\",method=\"{m}\"}} {}",
                r.seconds
            );
            let _ = writeln!(
                o,
                "ibex_ps_rpc_seconds_count{{shard=\"{s}\",method=\"{m}\"}} {}",
                r.count
            );
        }
        o
    }
}

/// Answers `GET /metrics` on `listener` until the task is dropped.
pub(crate) async fn serve(listener: TcpListener, metrics: Arc<Metrics>, shard: Arc<Shard>) {
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            continue;
        };
        let (metrics, shard) = (metrics.clone(), shard.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            // A client that never finishes its request head is dropped, not waited on forever.
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                while n < buf.len() {
                    match sock.read(&mut buf[n..]).await {
                        Ok(0) | Err(_) => break,
                        Ok(k) => n += k,
                    }
                    if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            })
            .await;
            if read.is_err() {
                return;
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if head.starts_with("GET /metrics ") || head.starts_with("GET / ")
            {
                ("200 OK", metrics.render(&shard))
            } else {
                (
                    "404 Not Found",
                    "only GET /metrics is served here\n".to_string(),
                )
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
