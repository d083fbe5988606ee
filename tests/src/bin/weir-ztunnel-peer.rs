//! Builds the ztunnel test peer into its cache (`weir_tests::ztunnel`) unless the cache
//! already holds it, and prints the binary's path. `scripts/test` runs it before the
//! suite, so no test pays the build's minutes; a build that cannot be done fails here,
//! naming why.

fn main() -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let bin = weir_tests::ztunnel::binary()?;
    eprintln!("[ztunnel-peer] ready in {:.1} s", started.elapsed().as_secs_f64());
    println!("{}", bin.display());
    Ok(())
}
