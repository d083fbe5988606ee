//! An injected pod's containers run from Weir's built images instead of the host's
//! files: `istio-init` (and `istio-validation`) from the init image, `istio-proxy`
//! from the proxy image, each chrooted in its unpacked root ([`crate::oci`]), its
//! command line made as a runtime makes it from the image's config and the container's
//! `command`/`args`.

use std::{os::unix::process::CommandExt as _, path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

use super::manifest::Container;
use crate::oci::UnpackedImage;

/// The images a pod's Istio containers run from, as Helm values pointing
/// `global.proxy_init.image` and `global.proxy.image` at Weir's would make them.
pub struct PodImages {
    pub init: UnpackedImage,
    pub proxy: UnpackedImage,
}

impl PodImages {
    /// The image `container` runs: the init image for a run-to-completion init
    /// container, the proxy image for the sidecar.
    pub fn for_container(&self, container: &Container) -> &UnpackedImage {
        if container.is_sidecar() || container.name == "istio-proxy" { &self.proxy } else { &self.init }
    }
}

/// `container`'s argv in `image` as a runtime builds it: its `command` replaces the
/// image's entrypoint, its `args` the image's command; a program without a `/` is
/// found on the image's PATH inside its root. Returns the command (the program's path
/// inside the root, for a chrooted child) and the argv.
pub fn command(
    image: &UnpackedImage,
    command: Vec<String>,
    args: Vec<String>,
) -> anyhow::Result<(Command, Vec<String>)> {
    let mut argv = if command.is_empty() { image.entrypoint.clone() } else { command.clone() };
    argv.extend(if command.is_empty() && args.is_empty() { image.cmd.clone() } else { args });
    let Some(program) = argv.first().cloned() else { bail!("image {} has no entrypoint", image.name) };
    let path = if program.contains('/') {
        PathBuf::from(&program)
    } else {
        let search =
            image.env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v).context("image has no PATH")?;
        search
            .split(':')
            .map(|dir| PathBuf::from(dir).join(&program))
            .find(|p| image.path(&p.to_string_lossy()).is_file())
            .with_context(|| format!("{program} is not on image {}'s PATH {search}", image.name))?
    };
    if !image.path(&path.to_string_lossy()).is_file() {
        bail!("image {} has no {}", image.name, path.display());
    }
    let mut cmd = Command::new(&path);
    cmd.arg0(&program).args(&argv[1..]);
    Ok((cmd, argv))
}
