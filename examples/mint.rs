//! How long the egress listener takes to mint a new host's leaf, and to find it cached:
//! `bench/egress.sh` prints both. Usage: `mint [HOSTS]` (default 200).

use std::time::Instant;

fn main() -> anyhow::Result<()> {
    let n: usize = std::env::args().nth(1).map_or(Ok(200), |s| s.parse())?;
    let dir = tempfile::tempdir()?;
    let (cert, key) = idemproxy::ca::init(dir.path())?;
    let ca = idemproxy::ca::Authority::load(&cert, &key)?;
    let hosts: Vec<String> = (0..n).map(|i| format!("acct{i}.zendesk.com")).collect();
    let started = Instant::now();
    for h in &hosts {
        ca.server_config(h)?;
    }
    let first = started.elapsed().as_secs_f64() * 1e6 / n as f64;
    let started = Instant::now();
    for _ in 0..10 {
        for h in &hosts {
            ca.server_config(h)?;
        }
    }
    let cached = started.elapsed().as_secs_f64() * 1e6 / (10 * n) as f64;
    println!("{{\"hosts\": {n}, \"first_us\": {first:.0}, \"cached_us\": {cached:.2}}}");
    Ok(())
}
