//! The `verbs` provider: real RDMA (InfiniBand, RoCE, Soft-RoCE) over RC queue pairs, through
//! the `sideway` bindings. All verbs FFI lives in this folder.
//!
//! Setup goes over a TCP socket (see `bootstrap`); the socket then stays open so that its end
//! of file tells us the peer is gone. Frames move with SEND/RECV, rendezvous data with RDMA
//! READ (see [`VerbsLink`]). `docs/verbs.md` explains the design and how to test it on
//! Soft-RoCE.
//!
//! Settings (in `Config`, which `Config::from_env` fills from the environment):
//! `IBEX_RDMA_DEVICE` (e.g. `mlx5_0`, `rxe0`), `IBEX_RDMA_PORT`, `IBEX_GID_INDEX`,
//! `IBEX_VERBS_BUSY_POLL=1` (dedicated busy-poll thread instead of the completion channel),
//! `IBEX_VERBS_SPIN_US` (spin budget before sleeping, default 20).

mod bootstrap;
mod device;
mod domain;
mod link;
mod progress;

use std::net::SocketAddr;
use std::time::Duration;
use std::time::{SystemTime, UNIX_EPOCH};

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::queue_pair::{
    QueuePair, QueuePairAttribute, QueuePairAttributeMask, QueuePairState,
};
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};

pub use device::{device_available, fork_status};
pub use domain::RegStats;
pub use link::VerbsLink;

/// What this process holds registered on each RDMA device it uses, and how its registration
/// cache does: one entry per device (and port/GID choice) opened so far.
pub fn registration_stats() -> Vec<RegStats> {
    domain::all_stats()
}

use crate::config::Config;
use crate::error::{Error, Result};
use bootstrap::QpInfo;
use device::pin_error;
use domain::Domain;
use link::{Parts, SlotMem};
use progress::Progress;

/// Inline data we ask the device for; it may grant less (Soft-RoCE may grant none).
const WANT_INLINE: u32 = 128;
/// READ depth we use at most, whatever the device allows: enough to keep a link busy.
const MAX_READ_DEPTH: u32 = 16;

/// Which device, port and GID to use, and how to make progress. `listen` and `connect` take
/// them from their `Config` ([`VerbsOptions::from_config`]); set fields directly to run two endpoints on
/// different devices in one process.
#[derive(Debug, Clone)]
pub struct VerbsOptions {
    /// Device name (`IBEX_RDMA_DEVICE`); `None` = the first device with an ACTIVE port and a
    /// usable GID.
    pub device: Option<String>,
    /// Port number, from 1 (`IBEX_RDMA_PORT`); `None` = the first ACTIVE port.
    pub port: Option<u8>,
    /// GID table index (`IBEX_GID_INDEX`); `None` = a RoCE v2 GID (IPv4-mapped first) on
    /// Ethernet, index 0 on InfiniBand.
    pub gid_index: Option<u32>,
    /// Spin on the completion queue in a dedicated thread (`IBEX_VERBS_BUSY_POLL=1`) instead of
    /// spinning briefly and then sleeping on the completion channel.
    pub busy_poll: bool,
    /// How long `poll_event` spins on an empty completion queue before it sleeps
    /// (`IBEX_VERBS_SPIN_US`, default 20 µs). Longer trades CPU for latency.
    pub spin: Duration,
}

impl Default for VerbsOptions {
    fn default() -> Self {
        VerbsOptions {
            device: None,
            port: None,
            gid_index: None,
            busy_poll: false,
            spin: crate::config::VERBS_SPIN,
        }
    }
}

impl VerbsOptions {
    /// The options `config` names ([`Config::rdma_device`], [`Config::rdma_port`],
    /// [`Config::gid_index`], [`Config::verbs_busy_poll`], [`Config::verbs_spin`]; from
    /// `IBEX_RDMA_DEVICE`, `IBEX_RDMA_PORT`, `IBEX_GID_INDEX`, `IBEX_VERBS_BUSY_POLL`,
    /// `IBEX_VERBS_SPIN_US` through [`Config::from_env`]).
    pub fn from_config(config: &Config) -> VerbsOptions {
        VerbsOptions {
            device: config.rdma_device.clone(),
            port: config.rdma_port,
            gid_index: config.gid_index,
            busy_poll: config.verbs_busy_poll,
            spin: config.verbs_spin,
        }
    }
}

fn strip_scheme(addr: &str) -> &str {
    addr.strip_prefix("verbs://").unwrap_or(addr)
}

/// Listens for verbs connections on `addr` (`host:port`, optionally `verbs://host:port`; the
/// TCP bootstrap port). Fails at once, with the fix in the message, if no RDMA device is usable.
pub async fn listen(addr: &str, config: &Config) -> Result<VerbsListener> {
    listen_with(addr, config, VerbsOptions::from_config(config)).await
}

/// [`listen`] with explicit device options.
pub async fn listen_with(addr: &str, config: &Config, opts: VerbsOptions) -> Result<VerbsListener> {
    config.validate()?;
    if config.tls.is_some() {
        return Err(crate::tls::refuse_on_verbs(addr));
    }
    // Open the device now: a server without RDMA should fail at start, not at first accept.
    domain::get(&opts, config)?;
    let a = strip_scheme(addr);
    let tcp = TcpListener::bind(a)
        .await
        .map_err(|e| Error::io(format!("binding the verbs bootstrap socket {a}"), e))?;
    let local_addr = tcp
        .local_addr()
        .map_err(|e| Error::io("reading the bound address", e))?;
    Ok(VerbsListener {
        tcp,
        config: config.clone(),
        opts,
        local_addr,
    })
}

/// Connects to a verbs listener at `addr` (`host:port` or `verbs://host:port`).
pub async fn connect(addr: &str, config: &Config) -> Result<VerbsLink> {
    connect_with(addr, config, VerbsOptions::from_config(config)).await
}

/// [`connect`] with explicit device options.
pub async fn connect_with(addr: &str, config: &Config, opts: VerbsOptions) -> Result<VerbsLink> {
    config.validate()?;
    if config.tls.is_some() {
        return Err(crate::tls::refuse_on_verbs(addr));
    }
    // Fail on a missing device before touching the network.
    domain::get(&opts, config)?;
    let a = strip_scheme(addr);
    let tcp = tokio::time::timeout(bootstrap::TIMEOUT, TcpStream::connect(a))
        .await
        .map_err(|_| {
            Error::Timeout(format!(
                "connecting to {a}: no answer within {:?}",
                bootstrap::TIMEOUT
            ))
        })?
        .map_err(|e| Error::io(format!("connecting to the verbs bootstrap socket {a}"), e))?;
    establish(tcp, config, &opts, a.to_string()).await
}

/// A bound verbs listener. Each [`VerbsListener::accept`] sets up one queue pair.
#[derive(Debug)]
pub struct VerbsListener {
    tcp: TcpListener,
    config: Config,
    opts: VerbsOptions,
    local_addr: SocketAddr,
}

impl VerbsListener {
    /// The bootstrap address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits for the next peer and sets up its link.
    pub async fn accept(&self) -> Result<VerbsLink> {
        let (tcp, peer) = self.accept_stream().await?;
        establish(tcp, &self.config, &self.opts, peer).await
    }

    /// The next accepted bootstrap stream and its peer's address, before any set-up
    /// (cancel-safe).
    pub(crate) async fn accept_stream(&self) -> Result<(TcpStream, String)> {
        let (tcp, peer) = self
            .tcp
            .accept()
            .await
            .map_err(|e| Error::io("accepting a verbs bootstrap connection", e))?;
        Ok((tcp, peer.to_string()))
    }

    /// The device options accepted peers are set up with.
    pub(crate) fn options(&self) -> &VerbsOptions {
        &self.opts
    }
}

/// Sets up an accepted bootstrap stream (the listener side of [`VerbsListener::accept`]).
pub(crate) async fn accept_setup(
    tcp: TcpStream,
    config: &Config,
    opts: &VerbsOptions,
    peer: String,
) -> Result<VerbsLink> {
    establish(tcp, config, opts, peer).await
}

fn psn() -> u32 {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    (t ^ std::process::id().rotate_left(12)) & 0xFF_FFFF
}

fn qp_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::io(what.to_string(), std::io::Error::other(e.to_string()))
}

async fn establish(
    mut tcp: TcpStream,
    config: &Config,
    opts: &VerbsOptions,
    peer: String,
) -> Result<VerbsLink> {
    let _ = tcp.set_nodelay(true);
    let timeout = |what: &str| {
        Error::Timeout(format!(
            "verbs setup with {peer}: {what} took longer than {:?}",
            bootstrap::TIMEOUT
        ))
    };
    tokio::time::timeout(
        bootstrap::TIMEOUT,
        bootstrap::hello(&mut tcp, config, &peer),
    )
    .await
    .map_err(|_| timeout("hello"))??;

    let dom = domain::get(opts, config)?;
    let dev = &dom.dev;
    let n_recv = config.credits as usize * 2 + 16;
    let n_send = config.credits as usize + 16;
    let rd_cap = dev.max_qp_init_rd_atom.clamp(1, MAX_READ_DEPTH);
    let sq_depth = (n_send + rd_cap as usize + 2) as u32;
    if sq_depth > dev.max_qp_wr || n_recv as u32 > dev.max_qp_wr {
        return Err(Error::Config(format!(
            "queue depths (send {sq_depth}, receive {n_recv}) exceed what {} allows ({}); lower Config::credits",
            dev.name, dev.max_qp_wr
        )));
    }
    let cqe = (sq_depth as usize + n_recv + 16).min(dev.max_cqe.max(1) as usize) as u32;

    let channel = if opts.busy_poll {
        None
    } else {
        Some(
            dev.ctx
                .create_comp_channel()
                .map_err(|e| qp_err("creating a completion channel", e))?,
        )
    };
    // The builder is not `Send`: keep it out of the awaits below.
    let cq = {
        let mut cqb = dev.ctx.create_cq_builder();
        cqb.setup_cqe(cqe);
        if let Some(ch) = &channel {
            cqb.setup_comp_channel(ch, 0);
        }
        cqb.build().map_err(|e| {
            let src = std::io::Error::other(e.to_string());
            pin_error(format!("creating a completion queue of {cqe} entries"), src)
        })?
    };

    let build = |inline: u32| {
        dev.pd
            .create_qp_builder()
            .setup_max_send_wr(sq_depth)
            .setup_max_recv_wr(n_recv as u32)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(inline)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build_ex()
    };
    // rxe grants inline data but its ibv_wr_* inline path delivers nothing (seen with
    // rdma-core 44 on Linux 6.1): copy through the send slab there instead.
    let want_inline = if dev.soft_roce { 0 } else { WANT_INLINE };
    let mut qp = match build(want_inline) {
        Ok(qp) => qp,
        Err(_) => build(0).map_err(|e| {
            let src = match e.0 {
                sideway::ibverbs::queue_pair::CreateQueuePairErrorKind::Ibverbs(io) => io,
                #[allow(unreachable_patterns)]
                other => std::io::Error::other(other.to_string()),
            };
            pin_error(
                format!("creating a queue pair (send {sq_depth}, receive {n_recv} entries)"),
                src,
            )
        })?,
    };
    let max_inline = qp
        .query(QueuePairAttributeMask::Capabilities)
        .map(|(_, init)| init.max_inline_data() as usize)
        .unwrap_or(0)
        .min(want_inline as usize);

    let initial_recvs = n_recv.min(link::INITIAL_RECV_SLOTS);
    let recv = local_memory(&dom, initial_recvs * config.slot_size).await?;
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::Init)
        .setup_pkey_index(0)
        .setup_port(dev.port)
        .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteRead);
    qp.modify(&attr)
        .map_err(|e| qp_err("moving the queue pair to INIT", e))?;
    VerbsLink::post_initial_recvs(&mut qp, &recv, initial_recvs, config.slot_size)?;

    let our_psn = psn();
    let rd_atom = dev.max_qp_rd_atom.clamp(1, 255);
    let ours = QpInfo {
        qpn: qp.qp_number(),
        psn: our_psn,
        gid: dev.gid.raw,
        lid: dev.lid,
        mtu: dev.active_mtu as u32,
        recv_slots: n_recv as u32,
        slot_size: config.slot_size as u32,
        max_rd_atom: rd_atom,
    };
    let theirs = tokio::time::timeout(
        bootstrap::TIMEOUT,
        bootstrap::exchange_info(&mut tcp, &ours),
    )
    .await
    .map_err(|_| timeout("queue pair exchange"))??;
    tracing::debug!(device = ?dev, ?ours, ?theirs, "verbs: connecting queue pairs");

    // QpInfo::decode bounded it (16 MiB at most).
    let max_frame = theirs.slot_size as usize;
    let send = local_memory(&dom, n_send.min(link::INITIAL_SEND_SLOTS) * max_frame).await?;
    let max_rd = rd_cap.min(theirs.max_rd_atom).max(1);

    let mtu = dev.active_mtu.min(Mtu::from(theirs.mtu));
    let mut ah = AddressHandleAttribute::new();
    ah.setup_dest_lid(theirs.lid)
        .setup_port(dev.port)
        .setup_service_level(0)
        .setup_grh_src_gid_index(dev.gid_index)
        .setup_grh_dest_gid(&Gid { raw: theirs.gid })
        .setup_grh_hop_limit(64);
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::ReadyToReceive)
        .setup_path_mtu(mtu)
        .setup_dest_qp_num(theirs.qpn)
        .setup_rq_psn(theirs.psn)
        .setup_max_dest_read_atomic(rd_atom as u8)
        // 12 = 0.64 ms: how long a sender backs off when we have no receive posted.
        .setup_min_rnr_timer(12)
        .setup_address_vector(&ah);
    qp.modify(&attr).map_err(|e| {
        qp_err(
            "moving the queue pair to RTR (is the peer's GID reachable from this port?)",
            e,
        )
    })?;
    let mut attr = QueuePairAttribute::new();
    attr.setup_state(QueuePairState::ReadyToSend)
        .setup_sq_psn(our_psn)
        // ACK timeout 4.096 µs × 2^n, retried 7 times: 14 (67 ms) on hardware. Soft-RoCE is
        // software on both ends and, with many queue pairs busy (or under emulation), its ACKs
        // were seen late enough to exhaust the retries and kill healthy links; 18 (1.07 s)
        // there. A dead peer is still seen at once through the bootstrap socket.
        .setup_timeout(if dev.soft_roce { 18 } else { 14 })
        .setup_retry_cnt(7)
        // 7 = retry forever on receiver-not-ready: control frames may briefly outrun receives.
        .setup_rnr_retry(7)
        .setup_max_read_atomic(max_rd as u8);
    qp.modify(&attr)
        .map_err(|e| qp_err("moving the queue pair to RTS", e))?;

    tokio::time::timeout(bootstrap::TIMEOUT, bootstrap::ready(&mut tcp))
        .await
        .map_err(|_| timeout("ready"))??;

    let progress = match channel {
        Some(ch) => Progress::channel(cq, ch, opts.spin)?,
        None => Progress::busy(cq, opts.spin)?,
    };
    Ok(VerbsLink::new(Parts {
        qp,
        progress,
        domain: dom,
        recv,
        initial_recvs,
        n_recv,
        slot_size: config.slot_size,
        send,
        n_send,
        max_frame,
        max_inline,
        max_rd: max_rd as usize,
        tcp,
        peer,
    }))
}

/// `len` bytes of the domain's registered local memory: from a slab with room, or, when
/// none has any, from a slab registered on a blocking thread (never on the runtime).
async fn local_memory(dom: &Arc<Domain>, len: usize) -> Result<SlotMem> {
    let len = len.max(1);
    if let Some((buf, lkey)) = dom.try_local(len) {
        return Ok(SlotMem { buf, lkey });
    }
    let d = dom.clone();
    let (buf, lkey) = tokio::task::spawn_blocking(move || d.local_or_register(len, false))
        .await
        .map_err(|e| Error::io("registering memory", std::io::Error::other(e.to_string())))??;
    Ok(SlotMem { buf, lkey })
}
