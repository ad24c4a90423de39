//! PostgreSQL's server binaries, for the test clusters of [`super::pg`] and [`super::ha`]:
//! where they are, and how to run them (as the `postgres` user when we are root: `initdb`
//! refuses root).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The newest `/usr/lib/postgresql/*/bin` (else a directory on `PATH`) that holds every one
/// of `tools`.
pub fn find(tools: &[&str]) -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    candidates.sort();
    candidates.reverse();
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path));
    }
    candidates
        .into_iter()
        .find(|d| tools.iter().all(|t| d.join(t).is_file()))
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Hands `dir` to the `postgres` user when we are root.
pub fn chown_to_postgres(dir: &Path) {
    if is_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(dir)
            .status()
            .expect("chown");
        assert!(status.success(), "chown {} to postgres", dir.display());
    }
}

/// `bin/NAME`, as the postgres user when we are root; no standard input.
pub fn command(bin: &Path, name: &str) -> Command {
    let exe = bin.join(name);
    let mut c = if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(exe);
        c
    } else {
        Command::new(exe)
    };
    c.stdin(Stdio::null());
    c
}

/// `pg_ctl -D data ARGS`: `Err` with its output when it fails.
pub fn pg_ctl(bin: &Path, data: &Path, args: &[&str]) -> Result<(), String> {
    let out = command(bin, "pg_ctl")
        .arg("-D")
        .arg(data)
        .args(args)
        .output()
        .expect("run pg_ctl");
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "pg_ctl {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

/// A new cluster in `data`: trust authentication, superuser `postgres`, UTF-8.
pub fn initdb(bin: &Path, data: &Path) {
    let out = command(bin, "initdb")
        .args([
            "--no-sync",
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "-D",
        ])
        .arg(data)
        .output()
        .expect("run initdb");
    assert!(
        out.status.success(),
        "initdb failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
