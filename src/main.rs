//! The `idemproxy` binary: the command line lives in [`idemproxy::cli`].

fn main() -> std::process::ExitCode {
    idemproxy::cli::main()
}
