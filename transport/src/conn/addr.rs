//! Addresses: `shm:///path/to.sock`, `tcp://host:port`, `verbs://host:port` (with the verbs
//! provider), and plain `host:port` for [`crate::connect_auto`].

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A parsed transport address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Addr {
    /// Unix socket path of an shm listener.
    Shm(PathBuf),
    /// `host:port` of a tcp listener.
    Tcp(String),
    /// `host:port` of a verbs listener.
    Verbs(String),
    /// `host:port` served over the best provider each side has ([`crate::listen_auto`],
    /// [`crate::connect_auto`]): shm for a peer on this host, verbs where there is an RDMA
    /// device, tcp otherwise.
    Auto(String),
}

impl Addr {
    /// Parses a URI. The error says which schemes exist.
    pub fn parse(uri: &str) -> Result<Addr> {
        let bad = |why: &str| Error::Address {
            addr: uri.to_string(),
            why: why.to_string(),
        };
        if let Some(rest) = uri.strip_prefix("shm://") {
            if !rest.starts_with('/') {
                return Err(bad(
                    "shm addresses are absolute socket paths: shm:///run/ibex.sock (three slashes)",
                ));
            }
            return Ok(Addr::Shm(PathBuf::from(rest)));
        }
        if let Some(rest) = uri.strip_prefix("tcp://") {
            check_host_port(rest).map_err(|w| bad(&w))?;
            return Ok(Addr::Tcp(rest.to_string()));
        }
        if let Some(rest) = uri.strip_prefix("verbs://") {
            check_host_port(rest).map_err(|w| bad(&w))?;
            return Ok(Addr::Verbs(rest.to_string()));
        }
        if let Some(rest) = uri.strip_prefix("ibex://") {
            check_host_port(rest).map_err(|w| bad(&w))?;
            return Ok(Addr::Auto(rest.to_string()));
        }
        Err(bad(
            "unknown scheme; use shm:///path.sock, tcp://host:port, verbs://host:port or \
             ibex://host:port (the best of the three)",
        ))
    }

    /// The URI form.
    pub fn to_uri(&self) -> String {
        match self {
            Addr::Shm(p) => format!("shm://{}", p.display()),
            Addr::Tcp(a) => format!("tcp://{a}"),
            Addr::Verbs(a) => format!("verbs://{a}"),
            Addr::Auto(a) => format!("ibex://{a}"),
        }
    }
}

fn check_host_port(s: &str) -> std::result::Result<(), String> {
    let (host, port) = s.rsplit_once(':').ok_or("expected host:port")?;
    if host.is_empty() {
        return Err("empty host".into());
    }
    port.parse::<u16>()
        .map_err(|_| format!("port {port:?} is not a number in 0..=65535"))?;
    Ok(())
}

/// Where the shm socket of an auto listener on `port` lives in `dir`
/// ([`crate::Config::shm_dir`]).
pub fn auto_shm_path(dir: &Path, port: u16) -> PathBuf {
    dir.join(format!("ibex-{port}.sock"))
}

/// True when `host` names this machine (loopback, or an address of a local interface).
pub fn is_local_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<IpAddr> = match (host, 0u16).to_socket_addrs() {
        Ok(it) => it.map(|a: SocketAddr| a.ip()).collect(),
        Err(_) => return false,
    };
    addrs
        .iter()
        .any(|ip| ip.is_loopback() || ip.is_unspecified() || local_ips().contains(ip))
}

fn local_ips() -> Vec<IpAddr> {
    // Binding a UDP socket to an address succeeds only for addresses of local interfaces,
    // which avoids parsing interface tables.
    let mut out = Vec::new();
    if let Ok(name) = std::fs::read_to_string("/proc/sys/kernel/hostname")
        && let Ok(it) = (name.trim(), 0u16).to_socket_addrs()
    {
        for a in it {
            if std::net::UdpSocket::bind((a.ip(), 0)).is_ok() {
                out.push(a.ip());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_schemes() {
        assert_eq!(
            Addr::parse("shm:///run/x.sock").unwrap(),
            Addr::Shm("/run/x.sock".into())
        );
        assert_eq!(
            Addr::parse("tcp://127.0.0.1:80").unwrap(),
            Addr::Tcp("127.0.0.1:80".into())
        );
        assert_eq!(
            Addr::parse("verbs://h:1").unwrap(),
            Addr::Verbs("h:1".into())
        );
        assert_eq!(
            Addr::parse("tcp://127.0.0.1:80").unwrap().to_uri(),
            "tcp://127.0.0.1:80"
        );
    }

    #[test]
    fn rejects_bad_addresses_with_reasons() {
        let e = Addr::parse("shm://relative.sock").unwrap_err().to_string();
        assert!(e.contains("three slashes"), "{e}");
        let e = Addr::parse("udp://x:1").unwrap_err().to_string();
        assert!(e.contains("unknown scheme"), "{e}");
        let e = Addr::parse("tcp://host:99999").unwrap_err().to_string();
        assert!(e.contains("port"), "{e}");
    }

    #[test]
    fn loopback_is_local() {
        assert!(is_local_host("127.0.0.1"));
        assert!(is_local_host("localhost"));
        assert!(!is_local_host("192.0.2.77"));
    }
}
