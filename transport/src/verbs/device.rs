//! Opening an RDMA device, choosing port and GID, and registering memory: everything that
//! turns an rdma-core failure into an error message that names the fix.

use std::io;
use std::sync::Arc;

use rdma_mummy_sys as sys;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::Gid;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
use sideway::ibverbs::memory_region::{MemoryRegion, RegisterMemoryRegionErrorKind};
use sideway::ibverbs::protection_domain::ProtectionDomain;

use super::VerbsOptions;
use crate::error::{Error, Result};

/// GID type value `ibv_query_gid_type` reports for RoCE v2 (`IBV_GID_TYPE_SYSFS_ROCE_V2`).
const GID_TYPE_ROCE_V2: u32 = 1;

const NO_DEVICE: &str = "no RDMA device found: install rdma-core and load a driver (e.g. rdma_rxe for Soft-RoCE), or use tcp://";

/// An opened device with the port and GID this side will use.
pub(crate) struct Device {
    pub ctx: Arc<DeviceContext>,
    pub pd: Arc<ProtectionDomain>,
    pub name: String,
    pub port: u8,
    pub gid_index: u8,
    pub gid: Gid,
    pub lid: u16,
    pub active_mtu: Mtu,
    /// Responder depth: RDMA READs the peer may have outstanding against us.
    pub max_qp_rd_atom: u32,
    /// Initiator depth: RDMA READs we may have outstanding.
    pub max_qp_init_rd_atom: u32,
    pub max_qp_wr: u32,
    pub max_cqe: u32,
    /// Soft-RoCE (rdma_rxe), which reports this vendor id.
    pub soft_roce: bool,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} port {} gid[{}] {}",
            self.name, self.port, self.gid_index, self.gid
        )
    }
}

fn no_device(source: io::Error) -> Error {
    Error::io(NO_DEVICE, source)
}

/// Makes registered memory safe across `fork` before anything is registered, and says how.
/// On kernels from 5.13 on, rdma-core reports `IBV_FORK_UNNEEDED`: the kernel copies pinned
/// pages for the child at fork, so the parent's registrations keep pointing at the parent's
/// pages and the child has ordinary copies. Then `ibv_fork_init` must *not* be called:
/// rdma-core 44 (Debian 12) still turns it on, marking every registered range
/// `MADV_DONTFORK`, so the child loses those pages (and heap memory that shares a page with
/// them: measured in the VM, a child that only allocated and filled 8 MiB died of SIGSEGV).
/// On older kernels `ibv_fork_init` is the only protection, with that cost. Runs once,
/// before the first device is opened.
pub(crate) fn fork_init() -> &'static str {
    static STATUS: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    STATUS.get_or_init(|| {
        // SAFETY: a query with no arguments.
        if unsafe { sys::ibv_is_fork_initialized() } == sys::IBV_FORK_UNNEEDED {
            return "unneeded (the kernel copies pinned pages on fork)";
        }
        // SAFETY: takes no arguments; rdma-core documents it as callable before any other
        // verb, which is where this runs (first device use in the process).
        let rc = unsafe { sys::ibv_fork_init() };
        // SAFETY: a query with no arguments.
        match unsafe { sys::ibv_is_fork_initialized() } {
            sys::IBV_FORK_ENABLED => "enabled (ibv_fork_init: registered pages are absent in a child)",
            _ => {
                tracing::warn!(rc, "verbs: ibv_fork_init failed; a fork while registered memory is in use may corrupt transfers");
                "disabled (ibv_fork_init failed)"
            }
        }
    })
}

/// How fork safety was obtained in this process ([`fork_init`]), for diagnostics.
pub fn fork_status() -> &'static str {
    fork_init()
}

/// True when rdma-core is present and lists at least one device. For tests and diagnostics.
pub fn device_available() -> bool {
    fork_init();
    DeviceList::new().map(|l| !l.is_empty()).unwrap_or(false)
}

/// Opens the device named in `opts` (or the first usable one) and allocates a protection domain.
pub(crate) fn open(opts: &VerbsOptions) -> Result<Device> {
    fork_init();
    let list = DeviceList::new().map_err(|e| {
        let src = match e.0 {
            sideway::ibverbs::device::GetDeviceListErrorKind::Ibverbs(io) => io,
            #[allow(unreachable_patterns)]
            _ => io::Error::other("ibv_get_device_list failed"),
        };
        no_device(src)
    })?;
    if list.is_empty() {
        return Err(no_device(io::Error::new(
            io::ErrorKind::NotFound,
            "ibv_get_device_list returned no devices",
        )));
    }
    let mut tried = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        if let Some(want) = &opts.device
            && &name != want
        {
            tried.push(name);
            continue;
        }
        let ctx = dev
            .open()
            .map_err(|e| Error::io(format!("opening RDMA device {name}"), io::Error::other(e)))?;
        match choose_port_and_gid(&ctx, opts) {
            Ok((port, gid_index, gid, lid, active_mtu)) => {
                let attr = ctx.query_device().map_err(|e| {
                    Error::io(format!("querying RDMA device {name}"), io::Error::other(e))
                })?;
                let pd = ctx.alloc_pd().map_err(|e| {
                    Error::io(
                        format!("allocating a protection domain on {name}"),
                        io::Error::other(e),
                    )
                })?;
                return Ok(Device {
                    ctx,
                    pd,
                    name,
                    port,
                    gid_index,
                    gid,
                    lid,
                    active_mtu,
                    max_qp_rd_atom: attr.max_qp_rd_atom().max(0) as u32,
                    max_qp_init_rd_atom: attr.max_qp_init_rd_atom().max(0) as u32,
                    max_qp_wr: attr.max_qp_wr().max(0) as u32,
                    max_cqe: attr.max_cqe().max(0) as u32,
                    soft_roce: attr.vendor_id() == 0xFF_FFFF,
                });
            }
            Err(why) if opts.device.is_some() => {
                return Err(Error::Config(format!(
                    "RDMA device {name} is not usable: {why} (IBEX_RDMA_DEVICE)"
                )));
            }
            Err(why) => tried.push(format!("{name} ({why})")),
        }
    }
    match &opts.device {
        Some(want) => Err(Error::Config(format!(
            "RDMA device {want:?} (IBEX_RDMA_DEVICE) not found; devices present: {}",
            tried.join(", ")
        ))),
        None => Err(no_device(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "no device has an ACTIVE port with a usable GID: {}",
                tried.join(", ")
            ),
        ))),
    }
}

/// Picks the port (first ACTIVE one unless given) and GID index. Without `IBEX_GID_INDEX` the
/// choice on Ethernet is a RoCE v2 GID, IPv4-mapped first: its route resolves at once, while
/// the link-local IPv6 GID needs neighbour discovery on the first connection.
fn choose_port_and_gid(
    ctx: &DeviceContext,
    opts: &VerbsOptions,
) -> std::result::Result<(u8, u8, Gid, u16, Mtu), String> {
    let attr = ctx
        .query_device()
        .map_err(|e| format!("query_device: {e}"))?;
    let ports: Vec<u8> = match opts.port {
        Some(p) => vec![p],
        None => (1..=attr.phys_port_cnt()).collect(),
    };
    let mut why = String::from("no port");
    for port in ports {
        let pattr = match ctx.query_port(port) {
            Ok(a) => a,
            Err(e) => {
                why = format!("port {port}: {e}");
                continue;
            }
        };
        if pattr.port_state() != PortState::Active {
            why = format!("port {port} is {:?}, not ACTIVE", pattr.port_state());
            continue;
        }
        let tbl = pattr.gid_tbl_len().max(0) as u32;
        let pick = if let Some(i) = opts.gid_index {
            if i >= tbl {
                return Err(format!(
                    "IBEX_GID_INDEX {i} is outside the GID table of port {port} ({tbl} entries)"
                ));
            }
            let gid = ctx
                .query_gid(port, i)
                .map_err(|e| format!("query_gid({i}): {e}"))?;
            if gid.is_zero() {
                return Err(format!(
                    "IBEX_GID_INDEX {i} is an empty GID entry on port {port}"
                ));
            }
            Some((i, gid))
        } else if pattr.link_layer() == LinkLayer::InfiniBand {
            ctx.query_gid(port, 0).ok().map(|g| (0, g))
        } else {
            let mut v2 = Vec::new();
            for i in 0..tbl.min(256) {
                let Ok(gid) = ctx.query_gid(port, i) else {
                    continue;
                };
                if gid.is_zero() || ctx.query_gid_type(port, i).ok() != Some(GID_TYPE_ROCE_V2) {
                    continue;
                }
                v2.push((i, gid));
            }
            let ipv4 = v2
                .iter()
                .copied()
                .find(|(_, g)| std::net::Ipv6Addr::from(*g).to_ipv4_mapped().is_some());
            ipv4.or_else(|| v2.first().copied())
        };
        match pick {
            Some((i, gid)) => {
                let idx = u8::try_from(i)
                    .map_err(|_| format!("GID index {i} does not fit the address vector"))?;
                return Ok((port, idx, gid, pattr.lid(), pattr.active_mtu()));
            }
            None => why = format!("port {port} has no RoCE v2 GID (set IBEX_GID_INDEX)"),
        }
    }
    Err(why)
}

fn memlock_kib() -> String {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct we pass, which lives on our stack.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 {
        "unknown".into()
    } else if lim.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        (lim.rlim_cur / 1024).to_string()
    }
}

/// Wraps an error from a call that pins memory (registration, QP or CQ creation) so that the
/// common cause, a low locked-memory limit, is named together with its fix.
pub(crate) fn pin_error(what: String, source: io::Error) -> Error {
    let memlock = matches!(
        source.raw_os_error(),
        Some(libc::ENOMEM) | Some(libc::EPERM)
    );
    if memlock {
        Error::io(
            format!(
                "{what} failed: the locked-memory limit is too low (ulimit -l is {} KiB); raise it (e.g. `ulimit -l unlimited`, \
                 /etc/security/limits.conf memlock, or LimitMEMLOCK= for systemd)",
                memlock_kib()
            ),
            source,
        )
    } else {
        Error::io(format!("{what} failed"), source)
    }
}

/// Registers `len` bytes at `ptr`.
///
/// # Safety
/// `ptr..ptr+len` must stay valid (and, with `LocalWrite`, writable) until the returned region
/// is dropped.
pub(crate) unsafe fn register(
    pd: &Arc<ProtectionDomain>,
    ptr: *const u8,
    len: usize,
    access: AccessFlags,
) -> Result<Arc<MemoryRegion>> {
    // SAFETY: forwarded to the caller.
    let r = unsafe { pd.reg_mr(ptr as usize, len, access) };
    r.map_err(|e| {
        let src = match e.0 {
            RegisterMemoryRegionErrorKind::Ibverbs(io) => io,
            other => io::Error::other(other.to_string()),
        };
        pin_error(format!("registering {len} bytes"), src)
    })
}

/// Zeroed heap memory registered with the device. The region is dropped (deregistered)
/// before the memory is freed.
pub(crate) struct Slab {
    mr: Arc<MemoryRegion>,
    mem: Box<[u8]>,
}

impl Slab {
    /// Allocates and registers `len` bytes (at least 1).
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize, access: AccessFlags) -> Result<Slab> {
        let mut mem = vec![0u8; len.max(1)].into_boxed_slice();
        // SAFETY: the memory is owned by the returned Slab, never moves (boxed), and outlives
        // `mr` because `mr` is declared first and so dropped first.
        let mr = unsafe { register(pd, mem.as_mut_ptr(), mem.len(), access)? };
        Ok(Slab { mr, mem })
    }

    pub fn base(&mut self) -> *mut u8 {
        self.mem.as_mut_ptr()
    }

    pub fn len(&self) -> usize {
        self.mem.len()
    }

    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub fn rkey(&self) -> u32 {
        self.mr.rkey()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinning_errors_name_the_memlock_fix() {
        let e = pin_error(
            "registering 4096 bytes".into(),
            io::Error::from_raw_os_error(libc::ENOMEM),
        )
        .to_string();
        assert!(
            e.contains("registering 4096 bytes failed")
                && e.contains("ulimit -l")
                && e.contains("LimitMEMLOCK"),
            "{e}"
        );
        let e = pin_error(
            "registering 1 bytes".into(),
            io::Error::from_raw_os_error(libc::EPERM),
        )
        .to_string();
        assert!(e.contains("locked-memory limit"), "{e}");
        let e = pin_error(
            "creating a queue pair".into(),
            io::Error::from_raw_os_error(libc::EINVAL),
        )
        .to_string();
        assert!(!e.contains("ulimit"), "{e}");
    }
}
