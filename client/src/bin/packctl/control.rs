//! Control-plane commands over gRPC (tonic on control.sock).

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;
use packd_client::CONTROL_SOCKET;
use packd_client::proto::GetStatsRequest;
use packd_client::proto::control_client::ControlClient;
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

async fn connect(dir: &Path) -> anyhow::Result<ControlClient<Channel>> {
    let path = dir.join(CONTROL_SOCKET);
    let channel = Endpoint::from_shared(format!("unix://{}", path.display()))?
        .connect()
        .await
        .with_context(|| format!("cannot connect to {} (is packd running?)", path.display()))?;
    Ok(ControlClient::new(channel))
}

/// `packctl stats`.
pub fn stats(dir: &Path, as_json: bool) -> anyhow::Result<ExitCode> {
    let s = runtime()?.block_on(async {
        let mut client = connect(dir).await?;
        Ok::<_, anyhow::Error>(client.get_stats(GetStatsRequest {}).await?.into_inner())
    })?;
    let doc = json!({
        "entries": s.entries, "segments": s.segments, "leases": s.leases, "clients": s.clients,
        "pack_jobs": s.pack_jobs, "pack_failures": s.pack_failures, "hits": s.hits, "misses": s.misses,
        "request_errors": s.request_errors, "bytes_resident": s.bytes_resident, "uptime_seconds": s.uptime_seconds, "isa": s.isa,
    });
    if as_json {
        println!("{doc}");
    } else if let Some(map) = doc.as_object() {
        for (k, v) in map {
            println!("{k:<16} {v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
