//! Connection setup over the Unix socket: the listener, the hello (the shared set-up
//! preface, [`crate::preface`], carrying shm's segment sizes), and the exchange of memfds
//! and eventfds with `SCM_RIGHTS`.
//!
//! Both sides run the same steps, so there is no client/server asymmetry after `accept`:
//! 1. send our hello, read the peer's, validate it (the preface compares auth tokens);
//! 2. create our segments, sized from the two hellos, and send their descriptors
//!    (TX ring read-write; pool and bounce area reopened read-only) with our two eventfds;
//! 3. receive the peer's descriptors, check each (sealed memfd of the announced size, or
//!    an eventfd), map them;
//! 4. probe CMA against the word the peer advertised, then exchange a one-byte ack so
//!    neither side starts before the other has validated everything.
//!
//! The whole exchange is bounded by [`SETUP_TIMEOUT`]: a peer that connects and says
//! nothing cannot hang `accept`.

use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};

use super::cma;
use super::link::{Parts, ShmLink};
use super::ring::{self, HEADER_BYTES};
use super::segment::{self, Mapping};
use super::share;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::preface::{self, Preface, Provider};

/// How long a whole setup may take before it is abandoned.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes shm adds to the preface: [`Hello::encode_ext`].
const HELLO_EXT: usize = 4 + 4 + 8 + 8 + 8 + 4 + 8 + 8;
/// Size of one bounce slot: large enough to amortise a request/answer pair, small enough
/// that several slots pipeline a fragment.
const BOUNCE_SLOT: usize = 256 << 10;
const BOUNCE_SLOTS: u32 = 8;
const FD_COUNT: usize = 5;
const ACK: u8 = b'K';

/// Data bytes of the ring we ask the peer to create for frames coming to us: all our
/// credits' worth of full slots plus headroom for control records, at least four maximal
/// records (a record may use at most a quarter of the ring), at most [`MAX_RX_RING`].
pub fn rx_ring_capacity(config: &Config) -> usize {
    let record = record_for(config.slot_size);
    let want = (config.credits as usize)
        .saturating_mul(record)
        .saturating_add(64 << 10);
    let cap = want.clamp(4 * record + 4096, MAX_RX_RING.max(4 * record + 4096));
    cap.div_ceil(4096) * 4096
}

/// Largest ring asked for by credits alone: beyond it the producer simply waits for space
/// (the consumer drains the ring without the application's help, so that cannot deadlock).
pub const MAX_RX_RING: usize = 256 << 20;

fn record_for(slot: usize) -> usize {
    ring::RECORD_HEADER + slot.div_ceil(8) * 8
}

fn pool_len(config: &Config) -> usize {
    config.pool_size.max(4096).div_ceil(4096) * 4096
}

/// A listening Unix socket for shm connections; the socket file is removed on drop.
#[derive(Debug)]
pub struct ShmListener {
    listener: UnixListener,
    path: PathBuf,
    config: Config,
    /// (device, inode) of the socket file we created, so drop removes ours and nobody else's.
    id: Option<(u64, u64)>,
}

fn file_id(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

fn addr_err(path: &Path, why: impl Into<String>) -> Error {
    Error::Address {
        addr: path.display().to_string(),
        why: why.into(),
    }
}

/// Listens for shm connections on the Unix socket `path` (mode 0600). A socket file left
/// behind by a dead process is replaced; a live one, or any other kind of file, is refused.
pub async fn listen(path: &Path, config: &Config) -> Result<ShmListener> {
    config.validate()?;
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(addr_err(
                path,
                "exists and is not a socket; remove it or choose another path",
            ));
        }
        // Non-blocking connect: a live listener with a full backlog answers EAGAIN.
        match UnixStream::connect(path).await {
            Ok(_) => {
                return Err(addr_err(
                    path,
                    "another process is listening there; stop it or choose another path",
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(addr_err(
                    path,
                    "another process is listening there (backlog full); choose another path",
                ));
            }
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(path = %path.display(), "replacing stale shm socket file");
                std::fs::remove_file(path).map_err(|e| {
                    Error::io(format!("removing stale socket {}", path.display()), e)
                })?;
            }
            Err(e) => {
                return Err(Error::io(
                    format!("checking whether {} is in use", path.display()),
                    e,
                ));
            }
        }
    }
    let listener = UnixListener::bind(path)
        .map_err(|e| Error::io(format!("binding shm socket {}", path.display()), e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("restricting {} to mode 0600", path.display()), e))?;
    let l = ShmListener {
        listener,
        path: path.to_path_buf(),
        config: config.clone(),
        id: file_id(path),
    };
    live_files::add(l.socket_file());
    Ok(l)
}

impl ShmListener {
    /// Waits for the next peer and sets its link up.
    ///
    /// A connection that closes before sending anything (such as the liveness check of
    /// another process's [`listen`] on the same path) is skipped, not reported.
    pub async fn accept(&self) -> Result<ShmLink> {
        loop {
            let stream = self.accept_stream().await?;
            match establish(stream, &self.config, &self.path, false).await? {
                Some(link) => return Ok(link),
                None => {
                    tracing::debug!(path = %self.path.display(), "skipped a connection that closed before its hello")
                }
            }
        }
    }

    /// The next accepted stream, before any set-up (cancel-safe).
    pub(crate) async fn accept_stream(&self) -> Result<UnixStream> {
        let (stream, _) = self
            .listener
            .accept()
            .await
            .map_err(|e| Error::io(format!("accepting on {}", self.path.display()), e))?;
        Ok(stream)
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What removes this listener's socket file, for an owner that must remove it at once
    /// even while the listener itself lives on in a task that is still being torn down.
    pub(crate) fn socket_file(&self) -> SocketFile {
        SocketFile {
            path: self.path.clone(),
            id: self.id,
        }
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        self.socket_file().remove();
    }
}

/// Checks the shm bytes of a peer's preface the way set-up does, before any memory is
/// shared: for tests and fuzzing of what a peer can send.
pub fn check_peer_preface(p: &Preface) -> Result<()> {
    Hello::from_preface(p).map(drop)
}

/// A socket file this process created, named by path and (device, inode).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SocketFile {
    path: PathBuf,
    id: Option<(u64, u64)>,
}

impl SocketFile {
    /// Removes the file if it is still ours: a listener that replaced it since keeps its own.
    pub(crate) fn remove(&self) {
        live_files::forget(self);
        self.unlink_if_ours();
    }

    fn unlink_if_ours(&self) {
        if self.id.is_some() && file_id(&self.path) == self.id {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The socket files of this process's live listeners, removed when the process exits
/// normally even if no destructor runs (`std::process::exit` runs none). A process that is
/// killed leaves its file behind; the next `listen` on the path finds nobody answering
/// there and replaces it.
mod live_files {
    use std::sync::{Mutex, Once};

    use super::SocketFile;

    static LIVE: Mutex<Vec<SocketFile>> = Mutex::new(Vec::new());
    static HOOK: Once = Once::new();

    pub(super) fn add(f: SocketFile) {
        HOOK.call_once(|| {
            // SAFETY: `at_exit` is an `extern "C" fn()` that never unwinds (it only takes a
            // lock without blocking and unlinks files); registering it has no other effect.
            // If registration fails, files are still removed by destructors.
            let _ = unsafe { libc::atexit(at_exit) };
        });
        LIVE.lock().unwrap_or_else(|e| e.into_inner()).push(f);
    }

    pub(super) fn forget(f: &SocketFile) {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = live.iter().position(|x| x == f) {
            live.swap_remove(i);
        }
    }

    extern "C" fn at_exit() {
        // try_lock: a thread that held the lock when `exit` was called must not hang the exit.
        let live = match LIVE.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        for f in live.iter() {
            f.unlink_if_ours();
        }
    }
}

/// Connects to an shm listener at `path` and sets the link up.
pub async fn connect(path: &Path, config: &Config) -> Result<ShmLink> {
    config.validate()?;
    let stream = UnixStream::connect(path).await.map_err(|e| {
        let hint = match e.kind() {
            io::ErrorKind::NotFound => "; is the peer listening there?",
            io::ErrorKind::ConnectionRefused => "; the listener is gone (stale socket file)",
            _ => "",
        };
        Error::io(
            format!("connecting to shm socket {}{hint}", path.display()),
            e,
        )
    })?;
    establish(stream, config, path, true).await?.ok_or_else(|| {
        Error::Handshake(format!(
            "the listener on {} closed the connection before its hello",
            path.display()
        ))
    })
}

/// Sets up an accepted stream with no deadline of its own (the caller bounds it).
/// `Ok(None)`: the peer hung up before sending a single byte.
pub(crate) async fn accept_setup(stream: UnixStream, config: &Config) -> Result<Option<ShmLink>> {
    handshake(stream, config, false).await
}

/// `Ok(None)`: the peer hung up before sending a single byte.
async fn establish(
    stream: UnixStream,
    config: &Config,
    path: &Path,
    dialer: bool,
) -> Result<Option<ShmLink>> {
    match tokio::time::timeout(SETUP_TIMEOUT, handshake(stream, config, dialer)).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout(format!(
            "shm setup on {} did not finish within {SETUP_TIMEOUT:?}; is the peer an ibex process of the same version?",
            path.display()
        ))),
    }
}

/// What each side announces before any memory is shared: the slot size from the preface,
/// the rest in shm's preface bytes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Hello {
    pub pid: u32,
    pub slot_size: u64,
    pub credits: u32,
    /// Data bytes of the ring the sender wants for frames coming to it.
    pub rx_ring: u64,
    pub pool_size: u64,
    pub bounce_slot: u64,
    pub bounce_slots: u32,
    pub probe_addr: u64,
    pub probe_value: u64,
}

impl Hello {
    /// shm's bytes of the preface (the slot size travels in the preface itself).
    fn encode_ext(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HELLO_EXT);
        b.extend_from_slice(&self.pid.to_le_bytes());
        b.extend_from_slice(&self.credits.to_le_bytes());
        b.extend_from_slice(&self.rx_ring.to_le_bytes());
        b.extend_from_slice(&self.pool_size.to_le_bytes());
        b.extend_from_slice(&self.bounce_slot.to_le_bytes());
        b.extend_from_slice(&self.bounce_slots.to_le_bytes());
        b.extend_from_slice(&self.probe_addr.to_le_bytes());
        b.extend_from_slice(&self.probe_value.to_le_bytes());
        debug_assert_eq!(b.len(), HELLO_EXT);
        b
    }

    /// The peer's hello from its (already checked) preface, validated.
    pub(crate) fn from_preface(p: &Preface) -> Result<Hello> {
        let Some(b) = p
            .ext
            .first_chunk::<HELLO_EXT>()
            .filter(|_| p.ext.len() == HELLO_EXT)
        else {
            return Err(Error::Handshake(format!(
                "the peer's hello carries {} bytes of shm set-up data, expected {HELLO_EXT}; run the same ibex version on both sides",
                p.ext.len()
            )));
        };
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(w)
        };
        let h = Hello {
            pid: u32_at(0),
            slot_size: u64::from(p.slot_size),
            credits: u32_at(4),
            rx_ring: u64_at(8),
            pool_size: u64_at(16),
            bounce_slot: u64_at(24),
            bounce_slots: u32_at(32),
            probe_addr: u64_at(36),
            probe_value: u64_at(44),
        };
        h.validate()?;
        Ok(h)
    }

    fn validate(&self) -> Result<()> {
        let bad = |what: String| {
            Err(Error::Handshake(format!(
                "the peer's hello is invalid: {what}"
            )))
        };
        if !(1..=65_536).contains(&self.credits) {
            return bad(format!("credits {} outside 1..=65536", self.credits));
        }
        if let Err(e) = ring::check_capacity(self.rx_ring as usize) {
            return bad(e);
        }
        if ring::max_payload(self.rx_ring as usize) < self.slot_size as usize {
            return bad(format!(
                "ring of {} bytes cannot hold a {}-byte frame",
                self.rx_ring, self.slot_size
            ));
        }
        if self.pool_size == 0 || !self.pool_size.is_multiple_of(4096) || self.pool_size > 1 << 40 {
            return bad(format!(
                "pool size {} is not a page multiple within 4 KiB..=1 TiB",
                self.pool_size
            ));
        }
        if !(4096..=16 << 20).contains(&self.bounce_slot) || !self.bounce_slot.is_multiple_of(4096)
        {
            return bad(format!("bounce slot of {} bytes", self.bounce_slot));
        }
        if !(1..=64).contains(&self.bounce_slots) {
            return bad(format!("{} bounce slots (1..=64)", self.bounce_slots));
        }
        Ok(())
    }

    pub fn bounce_len(&self) -> usize {
        self.bounce_slot as usize * self.bounce_slots as usize
    }
}

fn random_word() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(d.as_nanos());
    }
    h.finish() | 1
}

fn setup_io(what: &str) -> impl Fn(io::Error) -> Error + '_ {
    move |e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::Handshake(format!(
                "the peer closed the socket while {what}; it refused the setup (see its log for why)"
            ))
        } else {
            Error::io(format!("shm setup: {what}"), e)
        }
    }
}

/// The pid (in our pid namespace) and uid of the process at the other end of the socket.
fn socket_peer_cred(stream: &UnixStream) -> Result<(i32, u32)> {
    // SAFETY: `ucred` is plain data filled by the kernel.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: valid socket, out-pointer and length.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(Error::io(
            "reading the peer's credentials (SO_PEERCRED)",
            io::Error::last_os_error(),
        ));
    }
    Ok((cred.pid, cred.uid))
}

/// `dialer` tells the two ends of a connection to this same process apart (each gets its
/// own pool, see `share.rs`).
async fn handshake(
    mut stream: UnixStream,
    config: &Config,
    dialer: bool,
) -> Result<Option<ShmLink>> {
    let spin = config.shm_spin;
    let force = config.shm_force_bounce;
    cma::allow_peer_reads();
    let (peer_pid, peer_uid) = socket_peer_cred(&stream)?;
    let probe = Box::new(random_word());
    let me = Hello {
        pid: std::process::id(),
        slot_size: config.slot_size as u64,
        credits: config.credits,
        rx_ring: rx_ring_capacity(config) as u64,
        pool_size: pool_len(config) as u64,
        bounce_slot: BOUNCE_SLOT as u64,
        bounce_slots: BOUNCE_SLOTS,
        probe_addr: &*probe as *const u64 as u64,
        probe_value: *probe,
    };
    let ours = Preface::ours(config, me.encode_ext())?;
    let Some(theirs) = preface::exchange(&mut stream, Provider::Shm, &ours, "the shm peer").await?
    else {
        return Ok(None);
    };
    let peer = Hello::from_preface(&theirs)?;
    if peer.pid as i32 != peer_pid {
        tracing::debug!(
            hello_pid = peer.pid,
            socket_pid = peer_pid,
            "shm peer is in another pid namespace"
        );
    }

    // Our segments: the TX ring the peer asked for, our pool (shared by every connection
    // with this peer process) and bounce area.
    let tx_cap = peer.rx_ring as usize;
    let tx_fd = segment::memfd(c"ibex-shm-ring", HEADER_BYTES + tx_cap)?;
    let pool_size = me.pool_size as usize;
    let (pool, _) = share::own_pool(share::PeerKey::of(peer_pid, pool_size, dialer), pool_size)?;
    let bounce_fd = segment::memfd(c"ibex-shm-bounce", me.bounce_len())?;
    let data_efd = segment::eventfd()?;
    let space_efd = segment::eventfd()?;
    let bounce_ro = segment::reopen_readonly(bounce_fd.as_fd())?;
    let out = [
        tx_fd.as_fd(),
        pool.readonly.as_fd(),
        bounce_ro.as_fd(),
        data_efd.as_fd(),
        space_efd.as_fd(),
    ];
    stream
        .async_io(Interest::WRITABLE, || send_fds(&stream, &out))
        .await
        .map_err(setup_io("sending shared-memory descriptors"))?;
    drop(bounce_ro);
    let mut got = stream
        .async_io(Interest::READABLE, || recv_fds(&stream))
        .await
        .map_err(setup_io("receiving shared-memory descriptors"))?;
    if got.len() != FD_COUNT {
        return Err(Error::Handshake(format!(
            "the peer sent {} descriptors, expected {FD_COUNT}",
            got.len()
        )));
    }
    let peer_space_efd = got
        .pop()
        .ok_or_else(|| Error::Handshake("missing eventfd".into()))?;
    let peer_data_efd = got
        .pop()
        .ok_or_else(|| Error::Handshake("missing eventfd".into()))?;
    let (rx_fd, peer_pool_fd, peer_bounce_fd) = (&got[0], &got[1], &got[2]);
    segment::check_memfd(
        rx_fd.as_fd(),
        HEADER_BYTES + me.rx_ring as usize,
        "ring segment",
    )?;
    segment::check_memfd(peer_pool_fd.as_fd(), peer.pool_size as usize, "pool")?;
    segment::check_memfd(peer_bounce_fd.as_fd(), peer.bounce_len(), "bounce area")?;
    segment::check_eventfd(peer_data_efd.as_fd(), "data eventfd")?;
    segment::check_eventfd(peer_space_efd.as_fd(), "space eventfd")?;

    let tx_map = Mapping::map(tx_fd.as_fd(), HEADER_BYTES + tx_cap, true, "TX ring")?;
    let rx_map = Mapping::map(
        rx_fd.as_fd(),
        HEADER_BYTES + me.rx_ring as usize,
        true,
        "RX ring",
    )?;
    let (peer_pool, _) = share::peer_pool(peer_pool_fd.as_fd(), peer.pool_size as usize)?;
    let bounce = Mapping::map(bounce_fd.as_fd(), me.bounce_len(), true, "bounce area")?;
    let peer_bounce = Mapping::map(
        peer_bounce_fd.as_fd(),
        peer.bounce_len(),
        false,
        "peer bounce area",
    )?;
    // The mappings keep the memfds alive; their descriptors are no longer needed.
    drop((tx_fd, bounce_fd, got));

    let cma = if force {
        Err("IBEX_SHM_FORCE_BOUNCE=1".to_string())
    } else {
        cma::probe(peer_pid, peer.probe_addr, peer.probe_value)
    };
    match &cma {
        Ok(()) => tracing::info!(
            peer_pid,
            "shm link: rendezvous reads use CMA (process_vm_readv)"
        ),
        Err(reason) => {
            tracing::info!(peer_pid, %reason, "shm link: rendezvous reads use the bounce area")
        }
    }

    stream
        .write_all(&[ACK])
        .await
        .map_err(setup_io("acknowledging the setup"))?;
    let mut ack = [0u8; 1];
    stream
        .read_exact(&mut ack)
        .await
        .map_err(setup_io("waiting for the peer's acknowledgement"))?;
    if ack[0] != ACK {
        return Err(Error::Handshake(format!(
            "unexpected setup acknowledgement byte {:#x}",
            ack[0]
        )));
    }

    let link = ShmLink::new(Parts {
        sock: stream,
        peer_pid,
        peer_uid,
        peer_hello_pid: peer.pid,
        own_hello_pid: me.pid,
        peer_slot_size: peer.slot_size as usize,
        tx_map,
        tx_cap,
        rx_map,
        rx_cap: me.rx_ring as usize,
        pool,
        peer_pool,
        bounce,
        bounce_slot: me.bounce_slot as usize,
        peer_bounce,
        peer_bounce_slot: peer.bounce_slot as usize,
        data_efd,
        space_efd,
        peer_data_efd,
        peer_space_efd,
        cma: cma.is_ok(),
        probe,
        spin,
    })?;
    Ok(Some(link))
}

/// Control buffer big enough for more descriptors than we expect, so extra ones are seen
/// (and closed) rather than silently truncated.
const CMSG_FDS: usize = 16;

fn send_fds(stream: &UnixStream, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let raw: Vec<libc::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let payload = [b'F'];
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    let data_len = std::mem::size_of_val(raw.as_slice()) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; every pointer set below refers to a live local.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one header plus `data_len` bytes (CMSG_SPACE), so
    // CMSG_FIRSTHDR is non-null and CMSG_DATA has room for the descriptors.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as _;
        std::ptr::copy_nonoverlapping(
            raw.as_ptr().cast::<u8>(),
            libc::CMSG_DATA(cmsg),
            data_len as usize,
        );
    }
    // SAFETY: `msg` is fully initialised and its buffers outlive the call.
    let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n != 1 {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "descriptor message not sent",
        ));
    }
    Ok(())
}

fn recv_fds(stream: &UnixStream) -> io::Result<Vec<OwnedFd>> {
    let mut payload = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: payload.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let data_len = (CMSG_FDS * std::mem::size_of::<libc::c_int>()) as u32;
    // SAFETY: pure size computation.
    let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: plain data; pointers below refer to live locals.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` describes live buffers of the stated sizes.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` with `msg_controllen` bytes of well-formed
    // headers; the CMSG_* helpers walk them within that length. Each descriptor is wrapped
    // in an `OwnedFd` at once so every path closes it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg);
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if n == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "end of stream",
        ));
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other(
            "the peer sent more descriptors than expected (truncated)",
        ));
    }
    if payload[0] != b'F' {
        return Err(io::Error::other(format!(
            "unexpected setup message {:#x} instead of descriptors",
            payload[0]
        )));
    }
    Ok(fds)
}

#[cfg(all(test, not(ibex_loom)))]
mod tests {
    use super::*;

    fn hello() -> Hello {
        let c = Config::default();
        Hello {
            pid: 42,
            slot_size: c.slot_size as u64,
            credits: c.credits,
            rx_ring: rx_ring_capacity(&c) as u64,
            pool_size: pool_len(&c) as u64,
            bounce_slot: BOUNCE_SLOT as u64,
            bounce_slots: BOUNCE_SLOTS,
            probe_addr: 0x1000,
            probe_value: 7,
        }
    }

    fn preface_of(h: &Hello) -> Preface {
        Preface::ours(&Config::default(), h.encode_ext()).unwrap()
    }

    #[test]
    fn hello_round_trips_and_rejects_garbage() {
        let h = hello();
        assert_eq!(Hello::from_preface(&preface_of(&h)).unwrap(), h);

        let mut short = preface_of(&h);
        short.ext.pop();
        let e = Hello::from_preface(&short).unwrap_err().to_string();
        assert!(e.contains("expected 52"), "{e}");
        let tiny_ring = Hello {
            rx_ring: 64,
            ..h.clone()
        };
        let e = Hello::from_preface(&preface_of(&tiny_ring))
            .unwrap_err()
            .to_string();
        assert!(e.contains("ring"), "{e}");
        let no_credits = Hello { credits: 0, ..h };
        let e = Hello::from_preface(&preface_of(&no_credits))
            .unwrap_err()
            .to_string();
        assert!(e.contains("credits 0"), "{e}");
    }

    #[test]
    fn ring_capacity_holds_all_credits_and_big_records() {
        let c = Config::default();
        let cap = rx_ring_capacity(&c);
        assert!(cap >= c.credits as usize * c.slot_size);
        assert!(ring::max_payload(cap) >= c.slot_size);
        let c = Config {
            credits: 1,
            slot_size: 16 << 20,
            ..Config::default()
        };
        assert!(ring::max_payload(rx_ring_capacity(&c)) >= c.slot_size);
        let c = Config {
            credits: 65_536,
            slot_size: 16 << 20,
            ..Config::default()
        };
        assert!(rx_ring_capacity(&c) <= 1 << 30);
    }
}
