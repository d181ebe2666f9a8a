//! Free TCP ports for servers a test starts.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::sync::Mutex;

/// A port on 127.0.0.1 nothing listens on right now, never one this process handed out
/// before.
///
/// # Panics
/// When no such port can be found (the test cannot go on without one).
pub fn free_port() -> u16 {
    free_port_on("127.0.0.1")
}

/// [`free_port`] on `host` (an address of this machine).
///
/// The port is bound and released, so another process could take it before the server
/// binds it; that window is accepted. Within this process no port is handed out twice: the
/// kernel readily gives a just-released port to the next `bind(0)`, and two servers told
/// the same port (a shard and its metrics endpoint, say) would fail with "address in use".
///
/// # Panics
/// When `host` cannot be bound or no port this process has not handed out turns up.
pub fn free_port_on(host: &str) -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    // A test that panicked while holding the lock left the set intact: keep using it.
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    // Ports already handed out stay bound until a new one turns up, so that the kernel
    // offers a different one each time round.
    let mut held = Vec::new();
    for _ in 0..64 {
        let l = TcpListener::bind((host, 0))
            .unwrap_or_else(|e| panic!("cannot bind a port on {host}: {e}"));
        let port = l
            .local_addr()
            .unwrap_or_else(|e| panic!("reading the port bound on {host}: {e}"))
            .port();
        if given.insert(port) {
            return port;
        }
        held.push(l);
    }
    panic!("no port on {host} that this process has not handed out already");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_never_handed_out_twice() {
        let ports: BTreeSet<u16> = (0..200).map(|_| free_port()).collect();
        assert_eq!(ports.len(), 200);
        let p = free_port();
        TcpListener::bind(("127.0.0.1", p)).expect("the port is free");
    }
}
