//! RPC counters and latency histograms, served in the Prometheus text format by a minimal
//! HTTP/1.1 responder (`GET /metrics`), so the PS needs no web framework.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use ibex_transport::grpc::ServerStats;

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
    /// Value bytes sent as descriptors the worker read one-sided (part of `bytes_pulled`).
    pub bytes_pulled_exposed: AtomicU64,
    /// The Ibex server's connection counters (absent when serving stock gRPC).
    transport: OnceLock<ServerStats>,
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

    /// Adds the Ibex server's transport counters to the exposition.
    pub fn set_transport(&self, stats: ServerStats) {
        let _ = self.transport.set(stats);
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
        let _ = writeln!(o, "ibex_ps_variables{{shard=\"{s}\"}} {}", shard.num_vars());
        for (name, v) in [
            ("ibex_ps_bytes_pushed_total", &self.bytes_pushed),
            ("ibex_ps_bytes_pulled_total", &self.bytes_pulled),
            ("ibex_ps_bytes_remote_read_total", &self.bytes_remote),
            (
                "ibex_ps_bytes_pulled_exposed_total",
                &self.bytes_pulled_exposed,
            ),
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
        if let Some(t) = self.transport.get() {
            render_transport(&mut o, s, t);
        }
        #[cfg(feature = "verbs")]
        render_registrations(&mut o, s);
        o
    }
}

/// The process's registered memory per RDMA device: `ibv_reg_mr` calls (flat in a steady
/// state), pinned bytes by kind, and the registration cache's size.
#[cfg(feature = "verbs")]
fn render_registrations(o: &mut String, s: u32) {
    let stats = ibex_transport::verbs::registration_stats();
    if stats.is_empty() {
        return;
    }
    let _ = writeln!(
        o,
        "# HELP ibex_verbs_registrations_total Memory registrations (ibv_reg_mr) by this process.\n# TYPE ibex_verbs_registrations_total counter\n# HELP ibex_verbs_registered_bytes Registered memory by this process, by kind.\n# TYPE ibex_verbs_registered_bytes gauge"
    );
    for r in stats {
        let d = format!("shard=\"{s}\",device=\"{}\"", r.device);
        let _ = writeln!(
            o,
            "ibex_verbs_registrations_total{{{d}}} {}",
            r.registrations
        );
        for (kind, v) in [
            ("slabs", r.slab_bytes),
            ("exposable", r.exposable_bytes),
            ("pool", r.user_pool_bytes),
            ("cache", r.cache_bytes),
        ] {
            let _ = writeln!(o, "ibex_verbs_registered_bytes{{{d},kind=\"{kind}\"}} {v}");
        }
    }
}

/// Transport counters summed over every worker connection (open or ended, so counters never
/// go backwards), plus the registration-cache hit rate where memory gets registered (verbs).
fn render_transport(o: &mut String, s: u32, t: &ServerStats) {
    let (tot, conns) = t.totals();
    let p = &tot.proto;
    let open = t.connections().len();
    let _ = writeln!(
        o,
        "# HELP ibex_transport_connections Worker connections open now.\n# TYPE ibex_transport_connections gauge"
    );
    let _ = writeln!(o, "ibex_transport_connections{{shard=\"{s}\"}} {open}");
    let _ = writeln!(
        o,
        "# TYPE ibex_transport_connections_total counter\nibex_transport_connections_total{{shard=\"{s}\"}} {conns}"
    );
    let r = t.routes();
    let _ = writeln!(
        o,
        "# HELP ibex_grpc_calls_total Calls by route: direct handler, tonic's route (adapter), stock HTTP/2.\n# TYPE ibex_grpc_calls_total counter"
    );
    for (route, n) in [
        ("direct", r.direct),
        ("adapter", r.adapter),
        ("http2", r.http2),
    ] {
        let _ = writeln!(
            o,
            "ibex_grpc_calls_total{{shard=\"{s}\",route=\"{route}\"}} {n}"
        );
    }
    let (held, budget) = t.memory();
    let _ = writeln!(
        o,
        "# HELP ibex_grpc_memory_bytes What clients make the server hold (held) against its budget (--max-memory).\n# TYPE ibex_grpc_memory_bytes gauge\nibex_grpc_memory_bytes{{shard=\"{s}\",kind=\"held\"}} {held}\nibex_grpc_memory_bytes{{shard=\"{s}\",kind=\"budget\"}} {budget}"
    );
    if !tot.provider.is_empty() {
        let _ = writeln!(
            o,
            "# HELP ibex_transport_info Provider, rendezvous path and eager threshold of the connections.\n# TYPE ibex_transport_info gauge"
        );
        let _ = writeln!(
            o,
            "ibex_transport_info{{shard=\"{s}\",provider=\"{}\",path=\"{}\",threshold_source=\"{}\",fragment_source=\"{}\"}} 1",
            tot.provider, tot.rendezvous_path, p.threshold_source, p.fragment_source
        );
        let _ = writeln!(
            o,
            "# TYPE ibex_transport_eager_threshold_bytes gauge\nibex_transport_eager_threshold_bytes{{shard=\"{s}\"}} {}",
            p.eager_threshold
        );
        let _ = writeln!(
            o,
            "# TYPE ibex_transport_fragment_size_bytes gauge\nibex_transport_fragment_size_bytes{{shard=\"{s}\"}} {}",
            p.fragment_size
        );
    }
    let _ = writeln!(
        o,
        "# HELP ibex_transport_messages_total Transport messages by protocol and direction.\n# TYPE ibex_transport_messages_total counter"
    );
    let _ = writeln!(
        o,
        "# HELP ibex_transport_bytes_total Transport payload bytes by protocol and direction.\n# TYPE ibex_transport_bytes_total counter"
    );
    for (proto, dir, msgs, bytes) in [
        ("eager", "sent", p.eager_msgs_sent, p.eager_bytes_sent),
        ("eager", "received", p.eager_msgs_recv, p.eager_bytes_recv),
        ("rendezvous", "sent", p.rndv_msgs_sent, p.rndv_bytes_sent),
        (
            "rendezvous",
            "received",
            p.rndv_msgs_recv,
            p.rndv_bytes_recv,
        ),
    ] {
        let l = format!("shard=\"{s}\",protocol=\"{proto}\",direction=\"{dir}\"");
        let _ = writeln!(o, "ibex_transport_messages_total{{{l}}} {msgs}");
        let _ = writeln!(o, "ibex_transport_bytes_total{{{l}}} {bytes}");
    }
    for (name, help, v) in [
        (
            "ibex_transport_coalesced_messages_total",
            "Messages that shared an eager frame.",
            p.coalesced_msgs,
        ),
        (
            "ibex_transport_credit_stalls_total",
            "Times a ready frame waited for credits.",
            p.credit_stalls,
        ),
        (
            "ibex_transport_reads_total",
            "Rendezvous fragment reads issued.",
            p.reads_issued,
        ),
        (
            "ibex_transport_bytes_copied_total",
            "Payload bytes copied on receive (eager slots, rendezvous reads).",
            tot.payload_bytes_copied(),
        ),
        (
            "ibex_transport_bytes_mapped_total",
            "Rendezvous bytes received as views of the peer's pool (no copy).",
            tot.rndv_mapped_bytes,
        ),
        (
            "ibex_transport_remote_read_bytes_total",
            "Bytes moved by one-sided reads of exposed buffers.",
            tot.remote_read_bytes,
        ),
        (
            "ibex_transport_exposed_from_pool_total",
            "Exposed buffers that lay in the registered pool.",
            tot.exposed_from_pool,
        ),
        (
            "ibex_transport_reg_cache_hits_total",
            "Exposed buffers that reused a cached memory registration.",
            tot.reg_cache_hits,
        ),
        (
            "ibex_transport_reg_cache_misses_total",
            "Exposed buffers that had to be registered.",
            tot.reg_cache_misses,
        ),
    ] {
        let _ = writeln!(
            o,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{shard=\"{s}\"}} {v}"
        );
    }
    if let Some(rate) = tot.reg_cache_hit_rate() {
        let _ = writeln!(
            o,
            "# HELP ibex_transport_reg_cache_hit_ratio Exposures needing no new registration (pool or cache).\n# TYPE ibex_transport_reg_cache_hit_ratio gauge\nibex_transport_reg_cache_hit_ratio{{shard=\"{s}\"}} {rate}"
        );
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
