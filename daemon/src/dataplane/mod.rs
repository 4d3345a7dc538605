//! The data plane: `packd.sock`, framed protobuf requests, fd passing and leases.
//!
//! One task per connection; requests on a connection are answered in order. Any error on
//! one connection (bad frame, bad source, a peer that vanishes) ends at most that
//! connection and never touches another.
#![forbid(unsafe_code)]

mod conn;
pub mod frame;
mod request;

use std::sync::Arc;

use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::Daemon;

/// Accepts connections on `listener` until `shutdown` turns true.
pub async fn serve(listener: UnixListener, daemon: Arc<Daemon>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let daemon = Arc::clone(&daemon);
                    tokio::spawn(conn::serve(stream, daemon));
                }
                Err(e) => {
                    // EMFILE/ENFILE: back off instead of spinning; the listener stays.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.changed() => break,
        }
    }
}
