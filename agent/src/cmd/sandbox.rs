//! `weir sandbox reap|list`: what Weir's sandboxes (test pods, the demo) left on this
//! host, listed or removed.

use super::SandboxCommand;
use crate::sandbox;

pub fn run(command: SandboxCommand) -> anyhow::Result<()> {
    match command {
        SandboxCommand::Reap => {
            let reaped = sandbox::reap()?;
            println!("reaped {} sandbox object(s)", reaped.len());
            for item in reaped {
                println!("  {item}");
            }
        }
        SandboxCommand::List => {
            for item in sandbox::leftovers(false) {
                println!("{item}");
            }
        }
    }
    Ok(())
}
