//! `version` (pilot-agent's, weir's and weir-init's): the build, as text, JSON or YAML.

use super::{VersionArgs, VersionFormat};
use crate::support::{build_info::BUILD_INFO, exit};

/// `version` (pilot-agent's and weir's): prints the build as `args` asks.
pub fn print(args: &VersionArgs) -> u8 {
    if args.short {
        println!("{}", BUILD_INFO.version);
        return exit::OK;
    }
    match args.output {
        Some(VersionFormat::Json) => {
            println!("{}", serde_json::to_string_pretty(&BUILD_INFO).expect("build info serializes"))
        }
        Some(VersionFormat::Yaml) => {
            let value = serde_json::to_value(BUILD_INFO).expect("build info serializes");
            for (k, v) in value.as_object().into_iter().flatten() {
                println!("{k}: {}", v.as_str().unwrap_or_default());
            }
        }
        None => println!("{BUILD_INFO}"),
    }
    exit::OK
}
