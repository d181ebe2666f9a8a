//! Server processes for tests: started, awaited until they accept connections, their output
//! kept for assertions and failure messages, and killed when dropped.

use std::ffi::OsStr;
use std::fmt;
use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a server may take to accept connections by default: a hang guard for a loaded
/// 2-core machine, not a performance bar.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// How often the listen address is tried while a server starts. Nothing the server does
/// can be waited on more directly: it says where it will serve before it binds.
const POLL: Duration = Duration::from_millis(20);
/// How long a reaped server's pipes may take to deliver its last output.
const DRAIN_WITHIN: Duration = Duration::from_secs(5);

/// What a server process failed to do, with what it wrote.
pub struct LaunchError(String);

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

// `unwrap` and `expect` print Debug: keep the server's output readable there too.
impl fmt::Debug for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LaunchError {}

/// A server to start: program, arguments, environment, and the address whose accepting
/// connections means it is ready.
///
/// ```ignore
/// // In an integration test of ibex-ps, where Cargo names the binary:
/// let ps = ibex_test_support::Launch::new(env!("CARGO_BIN_EXE_ibex-ps"))
///     .listen("tcp://127.0.0.1:4000")
///     .args(["--mode", "sync"])
///     .spawn()
///     .expect("ibex-ps");
/// ```
pub struct Launch {
    what: String,
    cmd: Command,
    ready: Option<String>,
    within: Duration,
}

impl Launch {
    /// `program` is the binary's path. Cargo tells only the integration tests of the
    /// binary's own package where it is (`env!("CARGO_BIN_EXE_ibex-ps")` in ibex-ps's
    /// tests), so the caller names it rather than this crate guessing.
    ///
    /// The server is killed when the thread that spawned it ends, even if the test process
    /// dies without unwinding.
    pub fn new(program: impl AsRef<Path>) -> Launch {
        let program = program.as_ref();
        let what = program
            .file_name()
            .unwrap_or(program.as_os_str())
            .to_string_lossy()
            .into_owned();
        let mut cmd = Command::new(program);
        // Drop kills the server when a test fails by panicking; this covers a test process
        // that dies without unwinding (an abort, or killed by a harness's timeout). The
        // kernel sends the signal when the thread that started the server ends, so a
        // server belongs on the thread that holds it: the test's own (an async test's body
        // runs there too, under `block_on`).
        let parent = std::process::id();
        // SAFETY: the closure runs between fork and exec and makes only async-signal-safe
        // calls (prctl, getppid), allocating nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // The test died before the line above took effect: nobody will stop this.
                if libc::getppid() as u32 != parent {
                    return Err(io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        Launch {
            what,
            cmd,
            ready: None,
            within: READY_WITHIN,
        }
    }

    /// Passes `--listen URI` and waits, on [`Launch::spawn`], until `uri` accepts
    /// connections: for `tcp://`, `verbs://` (its TCP bootstrap port) and `http://`
    /// addresses, until the server listens on that port; for `shm://` paths, until their
    /// Unix socket takes a connection.
    pub fn listen(&mut self, uri: &str) -> &mut Launch {
        self.cmd.args(["--listen", uri]);
        self.ready_on(uri)
    }

    /// Waits, on [`Launch::spawn`], until `uri` (as for [`Launch::listen`]) accepts
    /// connections, for a server whose arguments name its address some other way.
    pub fn ready_on(&mut self, uri: &str) -> &mut Launch {
        self.ready = Some(uri.to_string());
        self
    }

    /// How long [`Launch::spawn`] waits for the server to accept connections (default 60 s).
    pub fn ready_within(&mut self, within: Duration) -> &mut Launch {
        self.within = within;
        self
    }

    /// Adds an argument.
    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Launch {
        self.cmd.arg(arg);
        self
    }

    /// Adds arguments.
    pub fn args<I, S>(&mut self, args: I) -> &mut Launch
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.cmd.args(args);
        self
    }

    /// Sets an environment variable of the server.
    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Launch {
        self.cmd.env(key, value);
        self
    }

    /// Leaves an environment variable of this process out of the server's.
    pub fn env_remove(&mut self, key: impl AsRef<OsStr>) -> &mut Launch {
        self.cmd.env_remove(key);
        self
    }

    /// Starts the server, its stdout and stderr captured, and returns once it listens on
    /// its address. Fails, naming what did not happen and with the server's output, when
    /// no address was given, the program cannot start, it exits first, or the deadline
    /// passes (the server is killed then). Call it on the thread that keeps the server
    /// (see [`Launch::new`]).
    pub fn spawn(&mut self) -> Result<Server, LaunchError> {
        let what = self.what.clone();
        let Some(uri) = self.ready.clone() else {
            return Err(LaunchError(format!(
                "{what}: no address to wait on; call Launch::listen or Launch::ready_on"
            )));
        };
        let endpoint =
            Endpoint::parse(&uri).map_err(|why| LaunchError(format!("{what}: {why}")))?;
        let mut child = self
            .cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| LaunchError(format!("cannot start {what}: {e}")))?;
        let output = Output::capture(child.stdout.take(), child.stderr.take());
        let mut server = Server {
            what,
            child,
            output,
        };
        let deadline = Instant::now() + self.within;
        loop {
            match server.child.try_wait() {
                Ok(None) => {}
                Ok(Some(status)) => {
                    server.output.drain(DRAIN_WITHIN);
                    return Err(server.failure(format!(
                        "exited ({status}) before accepting connections on {uri}"
                    )));
                }
                Err(e) => return Err(server.failure(format!("cannot be waited on: {e}"))),
            }
            if endpoint.accepts(server.child.id()) {
                return Ok(server);
            }
            if Instant::now() >= deadline {
                return Err(server.failure(format!(
                    "did not accept connections on {uri} within {:?}",
                    self.within
                )));
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Where a server accepts connections.
enum Endpoint {
    Tcp(u16),
    Unix(PathBuf),
}

impl Endpoint {
    fn parse(uri: &str) -> Result<Endpoint, String> {
        let bad = || format!("cannot tell where {uri:?} accepts connections");
        let (scheme, rest) = uri.split_once("://").ok_or_else(bad)?;
        match scheme {
            "shm" => Ok(Endpoint::Unix(PathBuf::from(rest))),
            "tcp" | "verbs" | "http" => rest
                .trim_end_matches('/')
                .rsplit_once(':')
                .and_then(|(_, port)| port.parse().ok())
                .map(Endpoint::Tcp)
                .ok_or_else(bad),
            _ => Err(bad()),
        }
    }

    /// Whether process `pid` accepts connections there now.
    fn accepts(&self, pid: u32) -> bool {
        match self {
            // Read from /proc rather than tried with a connection: a TCP peer that hangs up
            // before its preface is a failed set-up to an Ibex listener, which it logs (and
            // on verbs it would cost a queue pair).
            Endpoint::Tcp(port) => tcp_listening(pid, *port),
            // An shm listener takes a hang-up before the first byte for what it is, a
            // liveness check, and says nothing.
            Endpoint::Unix(path) => UnixStream::connect(path).is_ok(),
        }
    }
}

/// Whether process `pid` holds a TCP socket listening on `port` (any local address).
fn tcp_listening(pid: u32, port: u16) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let sockets: Vec<String> = fds
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|l| {
            let l = l.to_str()?;
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    // Lines of /proc/net/tcp{,6}: `sl local_address rem_address st ... uid timeout inode`,
    // the address as hex `ADDR:PORT`, state 0A for LISTEN.
    ["tcp", "tcp6"].iter().any(|table| {
        std::fs::read_to_string(format!("/proc/{pid}/net/{table}"))
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                f.len() > 9
                    && f[3] == "0A"
                    && f[1]
                        .rsplit_once(':')
                        .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
                        == Some(port)
                    && sockets.iter().any(|s| s == f[9])
            })
    })
}

/// What a process wrote to stdout and stderr, gathered by one thread per pipe.
struct Output {
    text: Arc<Mutex<Vec<u8>>>,
    /// Disconnected once both pipes are closed, that is all output is in `text`.
    done: Receiver<()>,
}

impl Output {
    fn capture(stdout: Option<ChildStdout>, stderr: Option<ChildStderr>) -> Output {
        let text = Arc::new(Mutex::new(Vec::new()));
        let (tx, done) = mpsc::channel();
        if let Some(p) = stdout {
            Self::gather(p, text.clone(), tx.clone());
        }
        if let Some(p) = stderr {
            Self::gather(p, text.clone(), tx);
        }
        Output { text, done }
    }

    fn gather(mut pipe: impl Read + Send + 'static, text: Arc<Mutex<Vec<u8>>>, done: Sender<()>) {
        std::thread::spawn(move || {
            let _done = done;
            let mut buf = [0u8; 8192];
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                text.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend_from_slice(&buf[..n]);
            }
        });
    }

    /// Waits until both pipes are closed (the process and anything it started have
    /// exited), at most `within`.
    fn drain(&self, within: Duration) {
        // Nothing is ever sent: the channel disconnects when both threads are done.
        let _: Result<(), RecvTimeoutError> = self.done.recv_timeout(within);
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.text.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

/// A running server process. Dropping it kills it (SIGKILL) and reaps it, also when a
/// test panics, and prints its output then, so that the failure shows what the server
/// said.
pub struct Server {
    what: String,
    child: Child,
    output: Output,
}

impl Server {
    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Everything the server wrote to stdout and stderr so far, interleaved as it came.
    pub fn output(&self) -> String {
        self.output.text()
    }

    /// The exit status, if the server has exited.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        self.child.try_wait()
    }

    /// Kills the server with SIGKILL, as a crash would, and reaps it: once this returns,
    /// its address is free for a successor.
    pub fn kill(&mut self) -> io::Result<ExitStatus> {
        self.child.kill()?;
        let status = self.child.wait()?;
        self.output.drain(DRAIN_WITHIN);
        Ok(status)
    }

    /// Sends SIGTERM, the request to shut down gracefully; [`Server::wait`] sees the end.
    pub fn terminate(&self) -> io::Result<()> {
        let pid = libc::pid_t::try_from(self.child.id())
            .map_err(|_| io::Error::other("the process id does not fit pid_t"))?;
        // SAFETY: kill(2) on a child not reaped yet (reaping takes `&mut self`), so the
        // pid is still this child's.
        if unsafe { libc::kill(pid, libc::SIGTERM) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Waits for the server to exit, at most `within`; then all its output is in
    /// [`Server::output`].
    pub fn wait(&mut self, within: Duration) -> Result<ExitStatus, LaunchError> {
        let deadline = Instant::now() + within;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.output.drain(DRAIN_WITHIN);
                    return Ok(status);
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                Ok(None) => {
                    return Err(self.failure(format!("did not exit within {within:?}")));
                }
                Err(e) => return Err(self.failure(format!("cannot be waited on: {e}"))),
            }
        }
    }

    fn failure(&self, what_happened: String) -> LaunchError {
        LaunchError(format!(
            "{} (pid {}) {what_happened}; its output:\n{}",
            self.what,
            self.child.id(),
            self.output()
        ))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGKILL cannot be ignored, so the wait after it returns.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            self.output.drain(DRAIN_WITHIN);
            eprintln!(
                "{} (pid {}) output:\n{}",
                self.what,
                self.child.id(),
                self.output()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;
    use std::os::unix::process::ExitStatusExt;

    /// Not a test of its own: the server the tests below start, by running this test
    /// binary again with `IBEX_TEST_SUPPORT_SERVE` set to what it should do.
    #[test]
    #[ignore]
    fn fake_server() {
        let Ok(job) = std::env::var("IBEX_TEST_SUPPORT_SERVE") else {
            return;
        };
        println!("starting");
        let _listener: Box<dyn std::any::Any> = match job.split_once(':') {
            Some(("tcp", port)) => {
                Box::new(std::net::TcpListener::bind(format!("127.0.0.1:{port}")).unwrap())
            }
            Some(("unix", path)) => Box::new(std::os::unix::net::UnixListener::bind(path).unwrap()),
            Some(("exit", why)) => {
                eprintln!("{why}");
                std::process::exit(3)
            }
            _ => Box::new(()),
        };
        println!("up");
        loop {
            std::thread::park();
        }
    }

    fn fake(job: &str) -> Launch {
        let mut l = Launch::new(std::env::current_exe().unwrap());
        l.args([
            "--exact",
            "process::tests::fake_server",
            "--ignored",
            "--nocapture",
        ])
        .env("IBEX_TEST_SUPPORT_SERVE", job);
        l
    }

    fn alive(pid: u32) -> bool {
        // SAFETY: signal 0 only checks that the pid exists.
        unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
    }

    #[test]
    fn a_server_is_ready_once_it_accepts_and_dies_with_its_handle() {
        let port = crate::free_port();
        let mut s = fake(&format!("tcp:{port}"))
            .ready_on(&format!("tcp://127.0.0.1:{port}"))
            .spawn()
            .expect("ready");
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        assert!(s.try_wait().unwrap().is_none());
        assert!(s.output().contains("up"), "{}", s.output());
        let pid = s.id();
        drop(s);
        assert!(!alive(pid), "killed and reaped");
    }

    #[test]
    fn a_panicking_test_leaves_no_server_behind() {
        let port = crate::free_port();
        let (tx, rx) = mpsc::channel();
        let test = std::thread::spawn(move || {
            let s = fake(&format!("tcp:{port}"))
                .ready_on(&format!("tcp://127.0.0.1:{port}"))
                .spawn()
                .expect("ready");
            tx.send(s.id()).unwrap();
            panic!("a failing test");
        });
        assert!(test.join().is_err());
        let pid = rx.recv().unwrap();
        assert!(!alive(pid), "killed and reaped while the test unwound");
    }

    #[test]
    fn the_server_dies_with_the_thread_that_started_it() {
        let port = crate::free_port();
        let pid = std::thread::spawn(move || {
            let s = fake(&format!("tcp:{port}"))
                .ready_on(&format!("tcp://127.0.0.1:{port}"))
                .spawn()
                .expect("ready");
            let pid = s.id();
            // As if the test process died: no Drop.
            std::mem::forget(s);
            pid
        })
        .join()
        .unwrap();
        // The kernel's SIGKILL is immediate, but reaping is ours: wait for the zombie.
        let deadline = Instant::now() + Duration::from_secs(10);
        let state = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| Some(s.rsplit_once(')')?.1.split_whitespace().next()?.to_string()))
        };
        while state().as_deref() != Some("Z") && Instant::now() < deadline {
            std::thread::sleep(POLL);
        }
        assert_eq!(
            state().as_deref(),
            Some("Z"),
            "the orphaned server was killed"
        );
        // SAFETY: reaps the zombie child this test left unreaped on purpose.
        unsafe { libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0) };
    }

    #[test]
    fn exiting_early_and_never_listening_are_errors_with_the_output() {
        let port = crate::free_port();
        let e = fake("exit:cannot bind")
            .ready_on(&format!("tcp://127.0.0.1:{port}"))
            .spawn()
            .err()
            .expect("an error")
            .to_string();
        assert!(e.contains("exited") && e.contains("cannot bind"), "{e}");
        let e = fake("silent")
            .ready_on(&format!("tcp://127.0.0.1:{port}"))
            .ready_within(Duration::from_millis(300))
            .spawn()
            .err()
            .expect("an error")
            .to_string();
        assert!(
            e.contains("did not accept connections") && e.contains("starting"),
            "{e}"
        );
        let e = fake("silent").spawn().err().expect("an error").to_string();
        assert!(e.contains("no address"), "{e}");
    }

    #[test]
    fn terminate_then_wait_sees_the_exit_and_kill_frees_the_address() {
        let dir = std::env::temp_dir().join(format!("ibex-test-support-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("s.sock");
        let mut s = fake(&format!("unix:{}", sock.display()))
            .ready_on(&format!("shm://{}", sock.display()))
            .spawn()
            .expect("ready");
        s.terminate().unwrap();
        let status = s.wait(Duration::from_secs(30)).unwrap();
        assert_eq!(status.signal(), Some(libc::SIGTERM));
        assert!(s.output().contains("up"), "{}", s.output());
        let port = crate::free_port();
        let mut s = fake(&format!("tcp:{port}"))
            .ready_on(&format!("tcp://127.0.0.1:{port}"))
            .spawn()
            .expect("ready");
        assert_eq!(s.kill().unwrap().signal(), Some(libc::SIGKILL));
        std::net::TcpListener::bind(("127.0.0.1", port)).expect("the port is free again");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
