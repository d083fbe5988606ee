//! A dry run: the run's own path through recorders in place of the system's tools, so
//! the report carries what would have run and nothing changes.

use super::{error::CaptureError, iptables::program_iptables, nft::program_nft, report::Report};
use crate::{
    inputs::config::{CaptureConfig, RunOptions},
    iptables::xtables::Recorder,
    nft::exec::NftRecorder,
};

/// A dry run: the same path with recorders; nothing is changed.
pub(crate) fn dry_run(cfg: &CaptureConfig, opts: &RunOptions) -> Result<Report, CaptureError> {
    if opts.native_nftables {
        let mut rec = NftRecorder::default();
        let mut report = program_nft(cfg, opts, &mut rec)?;
        report.transcript = Some(rec.transactions.concat());
        return Ok(report);
    }
    let mut rec = Recorder::default();
    let mut report = program_iptables(cfg, opts, &mut rec)?;
    report.transcript = Some(rec.transcript());
    Ok(report)
}
