//! The idemproxy binary on the system allocator, for heap profilers that intercept malloc
//! (valgrind's dhat): `valgrind --tool=dhat target/release/examples/sysalloc serve --config F`.

#[global_allocator]
static GLOBAL: std::alloc::System = std::alloc::System;

fn main() -> std::process::ExitCode {
    idemproxy::cli::main()
}
