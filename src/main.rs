//! The `idemproxy` binary: the command line lives in [`idemproxy::cli`].

/// mimalloc: the request path allocates many small, short-lived buffers across threads (the
/// body, headers, SQLite rows); glibc's malloc spent ~9% of a first write's CPU on them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    idemproxy::cli::main()
}
