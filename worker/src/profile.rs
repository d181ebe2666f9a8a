//! The worker's communication profile: what it sent and received, by message size and by
//! how the tensor bytes travelled (inline in the protobuf body, or as a remote-buffer
//! descriptor read one-sided by the PS), plus the Ibex connections' own counters.

use std::fmt;

/// Upper bounds of the size buckets, in bytes (the last bucket is unbounded).
const BUCKETS: [u64; 8] = [
    1 << 10,
    8 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    u64::MAX,
];

/// How one tensor payload travelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    Inline,
    Remote,
}

/// Counts per size bucket.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    /// Messages per bucket (bounds in [`CommProfile`]'s Display).
    pub counts: [u64; BUCKETS.len()],
    /// Total bytes.
    pub bytes: u64,
}

impl Histogram {
    fn add(&mut self, len: u64) {
        let i = BUCKETS
            .iter()
            .position(|b| len <= *b)
            .unwrap_or(BUCKETS.len() - 1);
        self.counts[i] += 1;
        self.bytes += len;
    }

    fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// A snapshot of a worker's communication counters.
#[derive(Debug, Clone, Default)]
pub struct CommProfile {
    /// Request bodies sent with tensors inline.
    pub sent_inline: Histogram,
    /// Tensors sent as remote-buffer descriptors (bytes = tensor bytes the PS read).
    pub sent_remote: Histogram,
    /// Response tensors received.
    pub received: Histogram,
    /// RPCs per method.
    pub rpcs: Vec<(&'static str, u64)>,
    /// Per-PS transport counters (Ibex channels only).
    pub transport: Vec<(usize, ibex_transport::ConnStats)>,
}

impl CommProfile {
    pub(crate) fn record_sent(&mut self, path: Path, len: u64) {
        match path {
            Path::Inline => self.sent_inline.add(len),
            Path::Remote => self.sent_remote.add(len),
        }
    }

    pub(crate) fn record_received(&mut self, len: u64) {
        self.received.add(len);
    }

    pub(crate) fn record_rpc(&mut self, method: &'static str) {
        match self.rpcs.iter_mut().find(|(m, _)| *m == method) {
            Some((_, n)) => *n += 1,
            None => self.rpcs.push((method, 1)),
        }
    }
}

fn label(i: usize) -> String {
    let lo = if i == 0 { 0 } else { BUCKETS[i - 1] + 1 };
    let fmt = |b: u64| match b {
        u64::MAX => "inf".to_string(),
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => b.to_string(),
    };
    if i == 0 {
        format!("<= {}", fmt(BUCKETS[0]))
    } else {
        format!("{}..{}", fmt(lo - 1), fmt(BUCKETS[i]))
    }
}

impl fmt::Display for CommProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "tensor payloads by size (count)   sent-inline  sent-remote  received"
        )?;
        for i in 0..BUCKETS.len() {
            let (a, b, c) = (
                self.sent_inline.counts[i],
                self.sent_remote.counts[i],
                self.received.counts[i],
            );
            if a + b + c > 0 {
                writeln!(f, "  {:<32}{a:>11}  {b:>11}  {c:>8}", label(i))?;
            }
        }
        writeln!(
            f,
            "  total: sent inline {} tensors / {} B, sent remote {} tensors / {} B, received {} tensors / {} B",
            self.sent_inline.total(),
            self.sent_inline.bytes,
            self.sent_remote.total(),
            self.sent_remote.bytes,
            self.received.total(),
            self.received.bytes
        )?;
        let rpcs: Vec<String> = self.rpcs.iter().map(|(m, n)| format!("{m} {n}")).collect();
        writeln!(f, "RPCs: {}", rpcs.join(", "))?;
        for (ps, s) in &self.transport {
            let p = &s.proto;
            writeln!(
                f,
                "PS {ps} transport {}: eager {} sent / {} received, rendezvous {} sent / {} received, {} B out / {} B in",
                s.provider,
                p.eager_msgs_sent,
                p.eager_msgs_recv,
                p.rndv_msgs_sent,
                p.rndv_msgs_recv,
                p.eager_bytes_sent + p.rndv_bytes_sent,
                p.eager_bytes_recv + p.rndv_bytes_recv
            )?;
        }
        Ok(())
    }
}
