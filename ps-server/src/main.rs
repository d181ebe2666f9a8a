//! `ibex-ps`: runs one parameter-server shard until SIGTERM or SIGINT, then writes a final
//! checkpoint. Flags: `ibex-ps --help`; details in docs/ps.md.

use tokio::signal::unix::{SignalKind, signal};

fn main() {
    // Warnings reach the operator's stderr: refused or evicted connections, peers that broke
    // the protocol, limits hit.
    ibex_ps::init_logging();
    // Before the runtime's threads exist: every step reuses the same message buffers.
    ibex_transport::conn::keep_freed_memory();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ibex-ps: starting the runtime: {e}");
            std::process::exit(1);
        }
    };
    rt.block_on(serve());
}

async fn serve() {
    let config = match ibex_ps::PsConfig::from_args(std::env::args()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ibex-ps: {e}");
            std::process::exit(2);
        }
    };
    // Start-up: without signal handlers the PS could not shut down gracefully at all.
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    if let Err(e) = ibex_ps::run(config, shutdown).await {
        eprintln!("ibex-ps: {e}");
        std::process::exit(1);
    }
}
