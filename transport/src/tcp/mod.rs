//! The `tcp` provider: a [`Link`](crate::link::Link) over one TCP stream, for hosts that
//! share no memory and have no RDMA.
//!
//! After the set-up preface each way ([`crate::preface`]), the stream carries typed records
//! ([`wire`]): core frames, read requests, and read responses. Rendezvous reads are
//! emulated: the reader sends a request naming an exposed region, the owner's link serves
//! it from inside its own `poll_event` (no involvement of its protocol core) with vectored
//! writes straight from the exposed buffer, and the reader's link moves the payload from
//! the socket straight into the destination. See `docs/tcp.md` for the design notes.
//!
//! ```no_run
//! # async fn demo() -> ibex_transport::Result<()> {
//! use ibex_transport::{Config, tcp};
//! let config = Config::default();
//! let listener = tcp::listen("127.0.0.1:0", &config).await?;
//! let addr = listener.local_addr()?.to_string();
//! let (server, client) = tokio::join!(listener.accept(), tcp::connect(&addr, &config));
//! let (_server, _client) = (server?, client?);
//! # Ok(()) }
//! ```

mod link;
pub mod wire;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::TcpStream;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::preface::{self, Preface, Provider};
pub(crate) use crate::tls::Role;

pub use link::TcpLink;

/// How long connection setup (TCP connect included, on the client) may take.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// A bound listening socket that hands out [`TcpLink`]s.
#[derive(Debug)]
pub struct TcpListener {
    inner: tokio::net::TcpListener,
    config: Config,
}

/// Connections the kernel may hold complete for the listener before it takes them. A
/// flood of peers that reconnect at once must not fill it: the kernel drops the handshake
/// of a peer past it, and an honest peer among them would wait a second for its retry.
/// The kernel caps it at `net.core.somaxconn`.
const BACKLOG: u32 = 4096;

/// Binds and listens on the first of `addrs` that works, with [`BACKLOG`].
fn bind(addrs: &[SocketAddr]) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in addrs {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        };
        let bound = socket.and_then(|s| {
            s.set_reuseaddr(true)?;
            s.bind(*a)?;
            s.listen(BACKLOG)
        });
        match bound {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no address to bind")))
}

/// Binds `addr` (`host:port`, port 0 for any) and listens for Ibex tcp peers.
pub async fn listen(addr: &str, config: &Config) -> Result<TcpListener> {
    config.validate()?;
    let addrs = resolve(addr).await?;
    let inner = bind(&addrs).map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
            ": the address is in use (is another server running there?)"
        } else {
            ""
        };
        Error::io(format!("cannot listen at {addr}{hint}"), e)
    })?;
    Ok(TcpListener {
        inner,
        config: config.clone(),
    })
}

impl TcpListener {
    /// The address actually bound (useful after binding port 0).
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.inner
            .local_addr()
            .map_err(|e| Error::io("reading the tcp listener's address", e))
    }

    /// Waits for the next peer and sets the connection up. A peer that fails setup (wrong
    /// protocol, wrong token, silent for [`SETUP_TIMEOUT`]) is an `Err` from this call; the
    /// listener stays usable. Setup runs inline, so one silent peer delays the next:
    /// [`crate::listen`]'s listener sets each peer up in a task of its own instead.
    pub async fn accept(&self) -> Result<TcpLink> {
        let (stream, peer) = self.accept_stream().await?;
        let work = setup(stream, &self.config, peer.clone(), Role::Server);
        match tokio::time::timeout(SETUP_TIMEOUT, work).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout(format!(
                "tcp peer {peer} connected but did not complete the Ibex preface within {} s",
                SETUP_TIMEOUT.as_secs()
            ))),
        }
    }
}

impl TcpListener {
    /// The next accepted stream and its peer's address, before any set-up (cancel-safe).
    pub(crate) async fn accept_stream(&self) -> Result<(TcpStream, String)> {
        let (stream, addr) = self
            .inner
            .accept()
            .await
            .map_err(|e| Error::io("accepting a tcp connection", e))?;
        Ok((stream, addr.to_string()))
    }
}

/// Connects to an Ibex tcp listener at `addr` (`host:port`).
pub async fn connect(addr: &str, config: &Config) -> Result<TcpLink> {
    config.validate()?;
    let work = async {
        let mut last = None;
        for a in resolve(addr).await? {
            match TcpStream::connect(a).await {
                Ok(stream) => {
                    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
                    return setup(stream, config, a.to_string(), Role::Client { host }).await;
                }
                Err(e) => last = Some((a, e)),
            }
        }
        let Some((a, e)) = last else {
            return Err(Error::Address {
                addr: addr.into(),
                why: "resolves to no address".into(),
            });
        };
        let shown = if a.to_string() == addr {
            addr.to_string()
        } else {
            format!("{addr} ({a})")
        };
        Err(if e.kind() == std::io::ErrorKind::ConnectionRefused {
            Error::io(
                format!("nothing listens at {shown}: is the server running?"),
                e,
            )
        } else {
            Error::io(format!("cannot connect to {shown}"), e)
        })
    };
    match tokio::time::timeout(SETUP_TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout(format!(
            "tcp connection to {addr} was not set up within {} s; check the address, firewalls, and that the server accepts",
            SETUP_TIMEOUT.as_secs()
        ))),
    }
}

async fn resolve(addr: &str) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| Error::Address {
            addr: addr.into(),
            why: format!("{e} (expected host:port, e.g. 10.0.0.2:7000)"),
        })?
        .collect();
    if addrs.is_empty() {
        return Err(Error::Address {
            addr: addr.into(),
            why: "resolves to no address".into(),
        });
    }
    Ok(addrs)
}

/// Turns on TCP keep-alive: the first probe after `idle` of silence, then three probes a
/// third of `idle` apart before the kernel fails the connection.
fn keepalive(stream: &TcpStream, idle: std::time::Duration) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let secs = |d: std::time::Duration| {
        libc::c_int::try_from(d.as_secs().max(1)).unwrap_or(libc::c_int::MAX)
    };
    let fd = stream.as_raw_fd();
    for (level, opt, val) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(idle)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs(idle / 3)),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ] {
        // SAFETY: `fd` is the open socket `stream` owns for the whole call; the option value
        // is a c_int that lives across the call, with its size passed alongside.
        let r = unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                (&val as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Runs the preface on a fresh stream (either side), inside TLS where [`Config::tls`] is
/// set; `peer` names the other end in errors. No deadline of its own: callers bound it.
pub(crate) async fn setup(
    mut stream: TcpStream,
    config: &Config,
    peer: String,
    role: Role<'_>,
) -> Result<TcpLink> {
    // Frames are latency-bound and already batched by the link's write queue.
    stream.set_nodelay(true).map_err(|e| {
        Error::io(
            format!("setting TCP_NODELAY on the connection to {peer}"),
            e,
        )
    })?;
    if let Some(idle) = config.tcp_keepalive {
        keepalive(&stream, idle).map_err(|e| {
            Error::io(
                format!("turning on TCP keep-alive (Config::tcp_keepalive) to {peer}"),
                e,
            )
        })?;
    }
    let mut ours = Preface::ours(config, Vec::new())?;
    ours.features |= preface::FEATURE_TCP_PUSH;
    let (stream, session, theirs) = match &config.tls {
        Some(tls) => {
            let (stream, session, theirs) =
                crate::tls::handshake(stream, tls, role, &peer, &ours).await?;
            (stream, Some(session), theirs)
        }
        None => {
            let who = format!("peer at {peer}");
            let theirs = preface::exchange(&mut stream, Provider::Tcp, &ours, &who)
                .await?
                .ok_or_else(|| preface::closed_during_setup(&who))?;
            (stream, None, theirs)
        }
    };
    tracing::debug!(%peer, peer_slot = theirs.slot_size, tls = session.is_some(), "tcp link set up");
    Ok(TcpLink::new(
        stream,
        session,
        peer,
        config,
        theirs.slot_size as usize,
        theirs.features & preface::FEATURE_TCP_PUSH != 0,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn get(stream: &TcpStream, level: libc::c_int, opt: libc::c_int) -> libc::c_int {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a valid socket, an out-pointer to a c_int and its length.
        let r = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                level,
                opt,
                (&mut v as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        v
    }

    #[tokio::test]
    async fn keepalive_sets_the_kernel_probes() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        assert_eq!(get(&s, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
        keepalive(&s, std::time::Duration::from_secs(9)).unwrap();
        assert_eq!(get(&s, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 9);
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 3);
        assert_eq!(get(&s, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
    }
}
