//! The `idemproxy` binary: the command line lives in [`idemproxy::cli`].

use std::time::Duration;

/// mimalloc: the request path allocates many small, short-lived buffers across threads (the
/// body, headers, SQLite rows); glibc's malloc spent ~9% of a first write's CPU on them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc gives freed pages back to the system only when it next runs after their delay:
/// memory freed as connections go idle (see `idemproxy::connection`) would stay resident in
/// a quiet process. A collection a second hands it back; purging at once instead cost first
/// writes 12% of their speed.
fn give_back_freed_memory() {
    let _ = std::thread::Builder::new()
        .name("idemproxy-mem".into())
        .spawn(|| loop {
            std::thread::sleep(Duration::from_secs(1));
            // SAFETY: `mi_collect` takes no pointers; any thread may call it at any time.
            unsafe { libmimalloc_sys::mi_collect(false) };
        });
}

fn main() -> std::process::ExitCode {
    give_back_freed_memory();
    idemproxy::cli::main()
}
