//! The metrics over HTTP/1.1 on a TCP listener: `GET /metrics` (any other path: 404).
//! Bounded: at most [`MAX_CONNECTIONS`] at once (more wait in the listen backlog), a request
//! head of at most 8 KiB read within [`HEAD_TIMEOUT`], and each connection closed after
//! [`CONNECTION_TIMEOUT`]. Rendering runs on the blocking pool, never on the runtime's
//! threads.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::render::{CONTENT_TYPE, Metrics};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Time to read a request's head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a connection may stay open.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest request head read.
const MAX_HEAD_BYTES: usize = 8 << 10;

async fn answer(metrics: Arc<Metrics>, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let reply = |status: StatusCode, ctype: &str, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        if let Ok(v) = ctype.parse() {
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
        }
        r
    };
    let text = "text/plain; charset=utf-8";
    if req.uri().path() != "/metrics" {
        return Ok(reply(StatusCode::NOT_FOUND, text, "packd serves its metrics at /metrics\n".into()));
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return Ok(reply(StatusCode::METHOD_NOT_ALLOWED, text, "use GET\n".into()));
    }
    match tokio::task::spawn_blocking(move || metrics.render()).await {
        Ok(body) => Ok(reply(StatusCode::OK, CONTENT_TYPE, body)),
        Err(e) => Ok(reply(StatusCode::INTERNAL_SERVER_ERROR, text, format!("rendering failed: {e}\n"))),
    }
}

/// Serves `metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        // A slot first: past the limit, connections wait in the kernel's backlog.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else { return };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "metrics listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(Arc::clone(&metrics), req));
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, conn).await;
            drop(slot);
        });
    }
}
