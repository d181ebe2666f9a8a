//! A listener under a reconnecting slowloris: hundreds of peers that connect, drip a valid
//! tcp preface one byte every 200 ms, and connect again as soon as the server closes them.
//! Meanwhile an honest peer makes a fresh connection and one round trip every 250 ms, and
//! each of those must be answered within a second, at about 200 connects a second and as
//! fast as the listener turns the slowloris away (over 20 k a second with two cores free),
//! which must be a fair share of what the machine makes against a listener that only
//! accepts and closes.
//!
//! Every peer, honest or not, comes from 127.0.0.1: the bound on set-ups per source
//! address cannot tell them apart, so what lets the honest peer in is the set-up slots
//! going by progress.

use std::collections::VecDeque;
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ibex_transport::preface::{Preface, Provider};
use ibex_transport::{Config, Listener, listen};

mod conn_util;
use conn_util::{HONEST_ROUNDS, fixed_threshold, honest_rounds, init_tracing, uri};

/// How the slowloris drips its preface.
const DRIP: Duration = Duration::from_millis(200);

/// The share of [`machine_ceiling`] that the unpaced slowloris must reach against the
/// listener (see the test).
const CEILING_SHARE: f64 = 0.3;

/// Echoes every message on every connection the listener hands over.
fn serve_echo(l: Arc<Listener>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok(c) = l.accept().await {
            tokio::spawn(async move {
                while let Ok(m) = c.recv().await {
                    if c.send(m).await.is_err() {
                        break;
                    }
                }
            });
        }
    })
}

/// The slowloris: `peers` sockets that each connect, drip the preface, and connect again
/// the moment the server closes them, all on one thread of their own with one epoll loop.
/// A task per peer on a runtime costs the flood more than the listener spends turning
/// each one away, and the flood would measure itself rather than the listener.
struct Slowloris {
    stop: Arc<AtomicBool>,
    connects: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl Slowloris {
    /// Starts it against `addr`, at `rate` connects per second, or as fast as the server
    /// closes its peers.
    fn start(addr: SocketAddrV4, peers: usize, rate: Option<u32>) -> Slowloris {
        let stop = Arc::new(AtomicBool::new(false));
        let connects = Arc::new(AtomicU64::new(0));
        let thread = std::thread::spawn({
            let (stop, connects) = (stop.clone(), connects.clone());
            move || Drip::new(addr, peers, rate).run(&stop, &connects)
        });
        Slowloris {
            stop,
            connects,
            thread,
        }
    }

    /// Connections made so far: those the server's kernel completed.
    fn connects(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }

    /// Stops it; every peer's socket is reset.
    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap();
    }
}

/// One slowloris peer's socket, while it has one.
struct Peer {
    fd: Option<OwnedFd>,
    /// Told apart from the peer's earlier sockets in epoll's events.
    generation: u32,
    connected: bool,
    /// The next preface byte it drips.
    next: usize,
}

/// The slowloris's loop and what it owns.
struct Drip {
    addr: libc::sockaddr_in,
    epoll: OwnedFd,
    peers: Vec<Peer>,
    /// Peers that want a socket, in turn.
    waiting: VecDeque<usize>,
    /// When each connected peer drips next, earliest first (every drip is `DRIP` apart).
    drips: VecDeque<(Instant, usize, u32)>,
    /// Connects per second, and the connects it may make now, when paced.
    rate: Option<u32>,
    tokens: f64,
    refilled: Instant,
    preface: Vec<u8>,
}

fn check(r: libc::c_int) -> std::io::Result<libc::c_int> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

impl Drip {
    fn new(addr: SocketAddrV4, peers: usize, rate: Option<u32>) -> Drip {
        // SAFETY: a plain syscall; the descriptor it returns is owned from here on.
        let epoll = check(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) }).unwrap();
        // SAFETY: an all-zero sockaddr_in is valid; the fields that matter are set below.
        let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
        sa.sin_family = libc::AF_INET as libc::sa_family_t;
        sa.sin_port = addr.port().to_be();
        sa.sin_addr.s_addr = u32::from_ne_bytes(addr.ip().octets());
        Drip {
            addr: sa,
            // SAFETY: `epoll` was just created and nothing else owns it.
            epoll: unsafe { OwnedFd::from_raw_fd(epoll) },
            peers: (0..peers)
                .map(|_| Peer {
                    fd: None,
                    generation: 0,
                    connected: false,
                    next: 0,
                })
                .collect(),
            waiting: (0..peers).collect(),
            drips: VecDeque::new(),
            rate,
            tokens: 0.0,
            refilled: Instant::now(),
            preface: Preface::ours(&Config::default(), Vec::new())
                .unwrap()
                .encode(Provider::Tcp),
        }
    }

    /// A fresh non-blocking socket for peer `i`, its connect under way. It closes with a
    /// reset (`SO_LINGER` 0), so that neither side keeps it in `TIME_WAIT` and a few
    /// thousand connects a second do not run out of ports.
    fn open(&mut self, i: usize) -> std::io::Result<()> {
        // SAFETY: plain syscalls on a descriptor this function owns (`OwnedFd` closes it
        // on every error path); the pointers are to live locals of the sizes given.
        unsafe {
            let fd = check(libc::socket(
                libc::AF_INET,
                libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            ))?;
            let fd = OwnedFd::from_raw_fd(fd);
            let linger = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            check(libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&raw const linger).cast(),
                size_of::<libc::linger>() as libc::socklen_t,
            ))?;
            if let Err(e) = check(libc::connect(
                fd.as_raw_fd(),
                (&raw const self.addr).cast(),
                size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )) && e.raw_os_error() != Some(libc::EINPROGRESS)
            {
                return Err(e);
            }
            let p = &mut self.peers[i];
            p.generation = p.generation.wrapping_add(1);
            // Edge-triggered: the connect's completion once, then each arrival once.
            let mut ev = libc::epoll_event {
                events: (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
                u64: (u64::from(p.generation) << 32) | i as u64,
            };
            check(libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                fd.as_raw_fd(),
                &mut ev,
            ))?;
            (p.fd, p.connected, p.next) = (Some(fd), false, 0);
        }
        Ok(())
    }

    /// Closes peer `i`'s socket (a reset) and puts it in line to connect again.
    fn close(&mut self, i: usize) {
        self.peers[i].fd = None;
        self.waiting.push_back(i);
    }

    /// Connects as many waiting peers as the pace allows.
    fn connect_waiting(&mut self, now: Instant) {
        if let Some(rate) = self.rate {
            let burst = f64::from((rate / 100).max(1) * 4);
            let dt = now.duration_since(self.refilled).as_secs_f64();
            self.tokens = (self.tokens + dt * f64::from(rate)).min(burst);
            self.refilled = now;
        }
        while let Some(&i) = self.waiting.front() {
            if self.rate.is_some() && self.tokens < 1.0 {
                break;
            }
            // Out of ports or descriptors for a moment: try again on the next round.
            if self.open(i).is_err() {
                break;
            }
            self.waiting.pop_front();
            self.tokens -= 1.0;
        }
    }

    /// What an event on peer `i` means: returns whether it made a connection.
    fn on_event(&mut self, i: usize, events: u32, now: Instant) -> bool {
        let events = events as libc::c_int;
        let p = &mut self.peers[i];
        let Some(fd) = p.fd.as_ref().map(|f| f.as_raw_fd()) else {
            return false;
        };
        let mut made = false;
        if !p.connected && events & libc::EPOLLOUT != 0 && events & libc::EPOLLERR == 0 {
            (p.connected, made) = (true, true);
            self.drips.push_back((now + DRIP, i, p.generation));
        }
        let mut closed = events & (libc::EPOLLERR | libc::EPOLLHUP | libc::EPOLLRDHUP) != 0;
        if !closed && events & libc::EPOLLIN != 0 {
            closed = drain(fd);
        }
        if closed {
            self.close(i);
        }
        made
    }

    /// Drips a byte on each peer whose time has come.
    fn drip(&mut self, now: Instant) {
        while let Some(&(at, i, generation)) = self.drips.front() {
            if at > now {
                break;
            }
            self.drips.pop_front();
            let p = &mut self.peers[i];
            let Some(fd) = p.fd.as_ref().filter(|_| p.generation == generation) else {
                continue;
            };
            // SAFETY: `fd` is open; one byte of the preface is readable at `next`.
            let sent = unsafe {
                libc::send(
                    fd.as_raw_fd(),
                    self.preface[p.next..].as_ptr().cast(),
                    1,
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if sent == 1 {
                p.next = (p.next + 1) % self.preface.len();
                self.drips.push_back((now + DRIP, i, generation));
            }
            // A failed send: the close it stems from comes as an event.
        }
    }

    fn run(mut self, stop: &AtomicBool, connects: &AtomicU64) {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 1024];
        while !stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            self.connect_waiting(now);
            self.drip(now);
            // SAFETY: `events` is writable for the length given.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as libc::c_int,
                    1,
                )
            };
            let now = Instant::now();
            let mut made = 0;
            for e in &events[..usize::try_from(n).unwrap_or(0)] {
                let (i, generation) = ((e.u64 & 0xffff_ffff) as usize, (e.u64 >> 32) as u32);
                // Events of a socket the peer has since closed and replaced are stale.
                if self.peers[i].generation == generation && self.on_event(i, e.events, now) {
                    made += 1;
                }
            }
            connects.fetch_add(made, Ordering::Relaxed);
        }
    }
}

/// Reads what the server sent until there is nothing more; returns whether it closed.
fn drain(fd: RawFd) -> bool {
    let mut sink = [0u8; 256];
    loop {
        // SAFETY: `fd` is open; `sink` is writable for its length.
        let n = unsafe { libc::recv(fd, sink.as_mut_ptr().cast(), sink.len(), libc::MSG_DONTWAIT) };
        match n {
            0 => return true,
            n if n > 0 => continue,
            _ => return std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock,
        }
    }
}

/// The connects a second the unpaced slowloris makes on this machine now against a
/// listener that does nothing but accept and close, on a thread of its own: what the
/// kernel and the slowloris allow, the most any listener could take.
fn machine_ceiling(peers: usize) -> f64 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // The listener's backlog, as Ibex's: a full one drops connects for a second.
    // SAFETY: a plain syscall on the listener's open socket.
    check(unsafe { libc::listen(l.as_raw_fd(), 4096) }).unwrap();
    let std::net::SocketAddr::V4(addr) = l.local_addr().unwrap() else {
        unreachable!("bound to an IPv4 address")
    };
    let done = Arc::new(AtomicBool::new(false));
    let server = std::thread::spawn({
        let done = done.clone();
        move || {
            while !done.load(Ordering::Relaxed) {
                drop(l.accept());
            }
        }
    });
    let flood = Slowloris::start(addr, peers, None);
    std::thread::sleep(Duration::from_millis(200));
    let (start, before) = (Instant::now(), flood.connects());
    std::thread::sleep(Duration::from_millis(800));
    let rate = (flood.connects() - before) as f64 / start.elapsed().as_secs_f64();
    flood.stop();
    done.store(true, Ordering::Relaxed);
    // Wakes the accept, which then sees `done`.
    drop(std::net::TcpStream::connect(addr));
    server.join().unwrap();
    rate
}

/// Runs the slowloris with `peers` peers (at `rate` connects per second, or as fast as
/// the server closes them) against a listener, while the honest peer comes back every
/// `conn_util::HONEST_EVERY`. Returns the honest round trips' times and the connects per
/// second the slowloris made meanwhile.
async fn under_slowloris(peers: usize, rate: Option<u32>) -> (Vec<Duration>, f64) {
    init_tracing();
    let cfg = fixed_threshold(4096);
    // The server has a runtime of its own, as it would be a process of its own: the honest
    // peer, on the test's runtime, then waits for the server only, not behind the tasks of
    // the server's set-ups to get its own preface out.
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let at = server
        .spawn({
            let cfg = cfg.clone();
            async move {
                let l = Arc::new(listen(&uri("tcp", "slowloris"), cfg).await.unwrap());
                let at = l.local_uri();
                serve_echo(l);
                at
            }
        })
        .await
        .unwrap();
    let addr = at.trim_start_matches("tcp://").parse().unwrap();

    // Its own thread, as it would be processes of its own: its peers queue behind each
    // other, not in front of the honest peer.
    let flood = Slowloris::start(addr, peers, rate);
    // Let the flood fill every set-up slot first.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (start, before) = (Instant::now(), flood.connects());
    let times = honest_rounds(&at, &cfg).await;
    let rate = (flood.connects() - before) as f64 / start.elapsed().as_secs_f64();

    flood.stop();
    server.shutdown_background();
    (times, rate)
}

fn report(what: &str, times: &[Duration], rate: f64) {
    let max = times.iter().max().copied().unwrap_or_default();
    let mut sorted = times.to_vec();
    sorted.sort();
    let p50 = sorted.get(sorted.len() / 2).copied().unwrap_or_default();
    println!(
        "{what}: slowloris at {rate:.0} connects/s; honest connect + round trip p50 {p50:?}, max {max:?} ({} rounds)",
        times.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honest_peer_gets_through_a_reconnecting_slowloris_at_200_connects_per_second() {
    let (times, rate) = under_slowloris(300, Some(200)).await;
    report("paced", &times, rate);
    assert_eq!(times.len(), HONEST_ROUNDS as usize);
    // The pacing holds it near 200; well below would mean the flood was not there.
    assert!(rate > 100.0, "the slowloris made only {rate:.0} connects/s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn honest_peer_gets_through_a_reconnecting_slowloris_at_full_speed() {
    const PEERS: usize = 1000;
    let ceiling = tokio::task::spawn_blocking(|| machine_ceiling(PEERS))
        .await
        .unwrap();
    let (times, rate) = under_slowloris(PEERS, None).await;
    report("flooding", &times, rate);
    println!("flooding: {ceiling:.0} connects/s against a listener that only accepts and closes");
    assert_eq!(times.len(), HONEST_ROUNDS as usize);
    // The kernel's work on each connect and close, both ends together, is most of what
    // the flood costs, so the rate follows the CPU the machine spares, which on a shared
    // machine changes from one run to the next: the floor is a share of what the machine
    // makes now with no listener work at all. Below it the flood was not at full strength,
    // or the listener fell far behind it.
    assert!(
        rate > CEILING_SHARE * ceiling,
        "the slowloris made only {rate:.0} connects/s, under {CEILING_SHARE} of the {ceiling:.0} this machine makes now"
    );
}
