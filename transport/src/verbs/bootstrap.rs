//! The TCP bootstrap: the set-up preface, then two small messages each way before the queue
//! pairs connect.
//!
//! 1. The preface ([`crate::preface`]: magic, version, slot size, features, auth token):
//!    checked before any device resource is spent on a peer that is not ours.
//! 2. `QpInfo`: queue pair number, PSN, GID, LID, MTU, receive slots and READ depth.
//! 3. One `READY` byte once the queue pair is in RTS, so neither side sends into a queue
//!    pair that cannot receive yet.
//!
//! The messages' bytes are in [`crate::verbs_wire`]. The socket then stays open and
//! silent until the end: a gracefully closing link writes one `BYE` byte and shuts it (see
//! `VerbsLink::close`); end of file without `BYE` means the peer process is gone.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::preface::{self, Preface, Provider};
pub(crate) use crate::verbs_wire::QpInfo;
use crate::verbs_wire::{READY, body_len, frame};

/// Generous because the first transition to RTR can take a second under emulation.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(30);

async fn write_msg(s: &mut TcpStream, body: &[u8]) -> Result<()> {
    s.write_all(&frame(body))
        .await
        .map_err(|e| Error::io("verbs bootstrap: sending to the peer", e))
}

async fn read_msg(s: &mut TcpStream) -> Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).await.map_err(gone)?;
    let mut body = vec![0u8; body_len(len)?];
    s.read_exact(&mut body).await.map_err(gone)?;
    Ok(body)
}

fn gone(e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::PeerGone("the peer closed the verbs bootstrap connection during setup (did it reject us? check its log)".into())
    } else {
        Error::io("verbs bootstrap: receiving from the peer", e)
    }
}

/// Exchanges and checks the preface. Both sides send first, so neither waits on the other.
pub(crate) async fn hello(s: &mut TcpStream, config: &Config, peer: &str) -> Result<()> {
    let ours = Preface::ours(config, Vec::new())?;
    let who = format!("verbs peer at {peer}");
    preface::exchange(s, Provider::Verbs, &ours, &who)
        .await?
        .ok_or_else(|| preface::closed_during_setup(&who))?;
    Ok(())
}

/// Sends ours, returns the peer's queue pair info.
pub(crate) async fn exchange_info(s: &mut TcpStream, ours: &QpInfo) -> Result<QpInfo> {
    write_msg(s, &ours.encode()).await?;
    QpInfo::decode(&read_msg(s).await?)
}

/// Tells the peer our queue pair is ready, waits for it to say the same.
pub(crate) async fn ready(s: &mut TcpStream) -> Result<()> {
    s.write_all(&[READY])
        .await
        .map_err(|e| Error::io("verbs bootstrap: sending ready", e))?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b).await.map_err(gone)?;
    if b[0] != READY {
        return Err(Error::Handshake(format!(
            "expected the peer's ready byte, got {:#x}",
            b[0]
        )));
    }
    Ok(())
}
