//! A client process for the publish tests: acquires a cache identity and, when it is made
//! the builder, builds a segment (a sealed memfd of deterministic bytes) and publishes it.
//! Prints one JSON line: `{"got":"segment"|"built"|"private"|"error", ...}`.
//!
//!   publisher DIR IDENTITY [--entries N] [--seed S] [--publish-when FILE] [--hang] [--hold S]
//!             [--build-seconds S] [--wait-seconds S]
//!
//! `--publish-when FILE` waits, once the builder, until FILE exists (at most a minute)
//! before publishing (a build the test ends when it has seen the others wait);
//! `--hang` never publishes (a builder that stalls until killed); `--hold` keeps the
//! process (and its lease) alive after printing.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use packd_client::{AcquireOptions, Acquired, Client, PublishEntry};

struct Args {
    dir: String,
    identity: String,
    entries: u64,
    seed: u8,
    publish_when: Option<std::path::PathBuf>,
    hang: bool,
    hold: u64,
    options: AcquireOptions,
    get: Option<String>,
}

fn parse() -> Args {
    let mut it = std::env::args().skip(1);
    let dir = it.next().expect("usage: publisher DIR IDENTITY [options]");
    let identity = it.next().expect("usage: publisher DIR IDENTITY [options]");
    let mut a = Args {
        dir,
        identity,
        entries: 3,
        seed: 1,
        publish_when: None,
        hang: false,
        hold: 0,
        options: AcquireOptions::default(),
        get: None,
    };
    while let Some(flag) = it.next() {
        let mut num = || it.next().and_then(|v| v.parse::<u64>().ok()).expect("a number after the flag");
        match flag.as_str() {
            "--entries" => a.entries = num(),
            "--seed" => a.seed = u8::try_from(num()).expect("seed fits a byte"),
            "--publish-when" => a.publish_when = it.next().map(Into::into),
            "--hold" => a.hold = num(),
            "--build-seconds" => a.options.build_seconds = u32::try_from(num()).expect("seconds"),
            "--wait-seconds" => a.options.wait_seconds = u32::try_from(num()).expect("seconds"),
            "--hang" => a.hang = true,
            "--get" => a.get = it.next(),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// The segment a builder of `entries` entries with `seed` publishes: entry i is 100 + i
/// bytes at offset 128 × i, each byte `seed + i + j`.
pub fn build(entries: u64, seed: u8) -> (std::fs::File, u64, Vec<PublishEntry>) {
    let file = memfd::MemfdOptions::default().allow_sealing(true).create("publisher").expect("memfd").into_file();
    let size = (entries * 128).div_ceil(4096).max(1) * 4096;
    file.set_len(size).expect("set_len");
    let mut table = Vec::new();
    for i in 0..entries {
        let bytes: Vec<u8> = (0..100 + i).map(|j| seed.wrapping_add((i + j).to_le_bytes()[0])).collect();
        file.write_all_at(&bytes, 128 * i).expect("write");
        table.push(PublishEntry { key: format!("op{i}"), offset: 128 * i, length: 100 + i });
    }
    let mfd = memfd::Memfd::try_from_file(file).expect("a memfd");
    mfd.add_seals(&[
        memfd::FileSeal::SealShrink,
        memfd::FileSeal::SealGrow,
        memfd::FileSeal::SealWrite,
        memfd::FileSeal::SealSeal,
    ])
    .expect("seal");
    (mfd.into_file(), size, table)
}

fn main() {
    let a = parse();
    let client = Client::connect(&a.dir).expect("connect");
    if let Some(key) = &a.get {
        let line = match client.get_segment(key) {
            Ok(seg) => format!(r#"{{"got":"segment","key":"{}"}}"#, seg.info().key),
            Err(e) => format!(r#"{{"got":"error","code":"{}"}}"#, e.code()),
        };
        finish(&line, 0, None);
        return;
    }
    let line = match client.acquire(&a.identity, a.options) {
        Ok(Acquired::Segment(seg)) => {
            let model = seg.map().expect("map");
            model.verify().expect("verify");
            let digest = blake3::hash(model.bytes());
            let line =
                format!(r#"{{"got":"segment","blake3":"{digest}","entries":{},"key":"{}"}}"#, model.len(), model.key());
            finish(&line, a.hold, Some(model));
            return;
        }
        Ok(Acquired::Build { .. }) => {
            if a.hang {
                println!(r#"{{"got":"building"}}"#);
                let _ = std::io::stdout().flush();
                std::thread::sleep(Duration::from_secs(3600));
            }
            if let Some(file) = &a.publish_when {
                let until = std::time::Instant::now() + Duration::from_secs(60);
                while !file.exists() && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let (file, size, table) = build(a.entries, a.seed);
            match client.publish(&a.identity, &file, size, &table) {
                Ok(seg) => {
                    let model = seg.map().expect("map");
                    let digest = blake3::hash(model.bytes());
                    let line = format!(
                        r#"{{"got":"built","blake3":"{digest}","entries":{},"key":"{}"}}"#,
                        model.len(),
                        model.key()
                    );
                    finish(&line, a.hold, Some(model));
                    return;
                }
                Err(e) => format!(r#"{{"got":"error","code":"{}"}}"#, e.code()),
            }
        }
        Ok(Acquired::Private { reason }) => format!(r#"{{"got":"private","reason":{reason:?}}}"#),
        Err(e) => format!(r#"{{"got":"error","code":"{}"}}"#, e.code()),
    };
    finish(&line, a.hold, None);
}

fn finish(line: &str, hold: u64, keep: Option<packd_client::Model>) {
    println!("{line}");
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_secs(hold));
    drop(keep);
}
