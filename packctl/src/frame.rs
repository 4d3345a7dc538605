//! `packctl frame`: data-plane frames as hex, built by the protocol crate's codec, for
//! scripts that speak the protocol by hand (`tests/attacks/attacks.py`): a protocol change
//! is then made in one place. Hidden from `--help`; not a user command.

use std::io::Read;

use anyhow::{Context, bail};
use clap::Subcommand;
use packd_proto::frame;
use packd_proto::v1::{self, request};
use prost::Message;

/// Which frame to print.
#[derive(Debug, Subcommand)]
pub enum FrameCmd {
    /// A pack request with the default plan (the model's fd travels beside it).
    Pack {
        /// The request id.
        #[arg(long, default_value_t = 1)]
        id: u64,
    },
    /// A get request.
    Get {
        /// The key.
        #[arg(long)]
        key: String,
        /// The request id.
        #[arg(long, default_value_t = 1)]
        id: u64,
    },
    /// A release of one lease.
    Release {
        /// The segment id.
        #[arg(long)]
        segment_id: u64,
        /// The daemon's generation.
        #[arg(long)]
        generation: u64,
    },
    /// A frame around arbitrary payload bytes (given as hex): a malformed request.
    Payload {
        /// The payload, hex.
        hex: String,
    },
    /// Only a header announcing `len` payload bytes.
    Header {
        /// The payload length announced.
        len: usize,
    },
    /// Reads a reply's payload (hex) on stdin and prints its segment's key.
    ReplyKey,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> anyhow::Result<Vec<u8>> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) {
        bail!("odd number of hex digits");
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).with_context(|| format!("not hex: {:?}", &text[i..i + 2])))
        .collect()
}

fn request(id: u64, body: request::Body) -> anyhow::Result<Vec<u8>> {
    Ok(frame::encode(&v1::Request { id, body: Some(body), progress: false })?)
}

/// Prints the frame `cmd` names, as hex.
pub fn run(cmd: FrameCmd) -> anyhow::Result<()> {
    let bytes = match cmd {
        FrameCmd::Pack { id } => {
            request(id, request::Body::Pack(v1::PackRequest { plan: Some(v1::Plan::default()), label: String::new() }))?
        }
        FrameCmd::Get { key, id } => request(id, request::Body::Get(v1::GetRequest { key, ..Default::default() }))?,
        FrameCmd::Release { segment_id, generation } => {
            request(0, request::Body::Release(v1::ReleaseRequest { segment_id, generation }))?
        }
        FrameCmd::Payload { hex } => frame::encode_payload(&unhex(&hex)?)?,
        FrameCmd::Header { len } => frame::header(len)?.to_vec(),
        FrameCmd::ReplyKey => {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text)?;
            let reply = v1::Reply::decode(unhex(&text)?.as_slice()).context("not a packd.v1.Reply")?;
            match reply.body {
                Some(v1::reply::Body::Segment(s)) => {
                    crate::output::emit(&format!("{}\n", s.key));
                    return Ok(());
                }
                other => bail!("not a segment reply: {other:?}"),
            }
        }
    };
    crate::output::emit(&format!("{}\n", hex(&bytes)));
    Ok(())
}
