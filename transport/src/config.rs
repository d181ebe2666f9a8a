//! Connection configuration, with the environment overrides users expect.

use crate::error::{Error, Result};

/// Tunables of one connection. Both sides may differ: what matters for the peer is
/// exchanged in the handshake (`Hello`).
#[derive(Debug, Clone)]
pub struct Config {
    /// Messages up to this size go eager, larger ones rendezvous. `None` = pick it with the
    /// probe at connection start (falls back to `default_eager_threshold` if the probe is off
    /// or fails). `IBEX_EAGER_THRESHOLD` overrides both.
    pub eager_threshold: Option<usize>,
    /// Threshold used until (or instead of) the probe's verdict.
    pub default_eager_threshold: usize,
    /// Run the connect-time threshold probe when `eager_threshold` is `None`.
    pub probe: bool,
    /// A probe not finished by then is abandoned and the default threshold kept
    /// (`IBEX_PROBE_TIMEOUT_MS`; default 2 s, far above what a real link needs).
    pub probe_timeout: std::time::Duration,
    /// Size of one eager receive slot = the largest frame the peer may send us.
    pub slot_size: usize,
    /// Number of eager receive slots = data frames the peer may have outstanding (credits).
    pub credits: u32,
    /// Rendezvous fragment size (bytes per one-sided read).
    pub fragment_size: usize,
    /// Reads in flight per connection.
    pub max_reads_in_flight: usize,
    /// Largest message this side accepts.
    pub max_message_size: u64,
    /// Size of the registered pool (shm: shared segment; verbs: registered slab) per direction.
    pub pool_size: usize,
    /// Optional shared secret that the peer must present at setup (`IBEX_AUTH_TOKEN`).
    pub auth_token: Option<String>,
    /// verbs: the RDMA device to use (e.g. `mlx5_0`, `rxe0`); overrides `IBEX_RDMA_DEVICE`.
    pub rdma_device: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            eager_threshold: None,
            default_eager_threshold: 16 * 1024,
            probe: true,
            probe_timeout: crate::proto::PROBE_TIMEOUT,
            slot_size: 64 * 1024,
            credits: 64,
            fragment_size: 512 * 1024,
            max_reads_in_flight: 8,
            max_message_size: 1 << 30,
            pool_size: 256 << 20,
            auth_token: None,
            rdma_device: None,
        }
    }
}

impl Config {
    /// The default configuration with environment overrides applied
    /// (`IBEX_EAGER_THRESHOLD`, `IBEX_FRAGMENT_SIZE`, `IBEX_AUTH_TOKEN`).
    pub fn from_env() -> Result<Self> {
        Config::default().with_env()
    }

    /// Applies environment overrides on top of `self`.
    pub fn with_env(mut self) -> Result<Self> {
        if let Some(v) = env_usize("IBEX_EAGER_THRESHOLD")? {
            self.eager_threshold = Some(v);
        }
        if let Some(v) = env_usize("IBEX_FRAGMENT_SIZE")? {
            self.fragment_size = v;
        }
        if let Ok(t) = std::env::var("IBEX_AUTH_TOKEN")
            && !t.is_empty()
        {
            self.auth_token = Some(t);
        }
        self.validate()?;
        Ok(self)
    }

    /// Checks that the values fit together.
    pub fn validate(&self) -> Result<()> {
        if self.slot_size < 1024 || self.slot_size > (16 << 20) {
            return Err(Error::Config(format!(
                "slot_size {} must be within 1 KiB..=16 MiB",
                self.slot_size
            )));
        }
        if self.credits == 0 || self.credits > 65_536 {
            return Err(Error::Config(format!(
                "credits {} must be within 1..=65536",
                self.credits
            )));
        }
        if self.fragment_size < 4096 || self.fragment_size > (64 << 20) {
            return Err(Error::Config(format!(
                "fragment_size {} must be within 4 KiB..=64 MiB",
                self.fragment_size
            )));
        }
        if self.max_reads_in_flight == 0 {
            return Err(Error::Config(
                "max_reads_in_flight must be at least 1".into(),
            ));
        }
        if let Some(t) = self.eager_threshold
            && t > self.max_eager()
        {
            return Err(Error::Config(format!(
                "eager threshold {t} exceeds what fits in one slot ({}); raise slot_size or lower IBEX_EAGER_THRESHOLD",
                self.max_eager()
            )));
        }
        Ok(())
    }

    /// The largest message that can travel eagerly with this slot size.
    pub fn max_eager(&self) -> usize {
        self.slot_size - crate::proto::EAGER_OVERHEAD
    }
}

fn env_usize(name: &str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) => parse_size(&v).map(Some).ok_or_else(|| {
            Error::Config(format!(
                "{name}={v:?} is not a size (examples: 8192, 16K, 1M)"
            ))
        }),
        Err(_) => Ok(None),
    }
}

/// Parses `8192`, `16K`, `16KiB`, `1M`, `1MiB`, `1G`.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let lower = s.to_ascii_lowercase();
    let (num, mult) = if let Some(n) = lower.strip_suffix("kib").or(lower.strip_suffix('k')) {
        (n, 1usize << 10)
    } else if let Some(n) = lower.strip_suffix("mib").or(lower.strip_suffix('m')) {
        (n, 1 << 20)
    } else if let Some(n) = lower.strip_suffix("gib").or(lower.strip_suffix('g')) {
        (n, 1 << 30)
    } else {
        (lower.as_str(), 1)
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8192"), Some(8192));
        assert_eq!(parse_size("16K"), Some(16384));
        assert_eq!(parse_size("1MiB"), Some(1 << 20));
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn threshold_must_fit_a_slot() {
        let c = Config {
            eager_threshold: Some(1 << 20),
            ..Config::default()
        };
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("slot")));
    }
}
