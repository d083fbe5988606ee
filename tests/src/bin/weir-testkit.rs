//! weir-testkit: the traffic tool tests run inside pods (std only, no async runtime).
//!
//!   weir-testkit serve-echo <addr>            TCP echo server; prints "listening <addr>"
//!   weir-testkit connect <addr> [count]       connects `count` times, sends a line,
//!                                             expects it echoed; prints "ok <n>"
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
    time::Duration,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve-echo") => arg_addr(&args, 1).and_then(serve_echo),
        Some("connect") => arg_addr(&args, 1).and_then(|addr| {
            let count =
                args.get(2).map(|c| c.parse::<u32>()).transpose().map_err(|e| format!("count: {e}"))?;
            connect(addr, count.unwrap_or(1))
        }),
        _ => Err("usage: weir-testkit serve-echo <addr> | connect <addr> [count]".to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("weir-testkit: {e}");
            ExitCode::FAILURE
        }
    }
}

fn arg_addr(args: &[String], i: usize) -> Result<SocketAddr, String> {
    let raw = args.get(i).ok_or("missing <addr>")?;
    raw.parse().map_err(|e| format!("address {raw:?}: {e}"))
}

fn serve_echo(addr: SocketAddr) -> Result<(), String> {
    let listener = TcpListener::bind(addr).map_err(|e| format!("bind {addr}: {e}"))?;
    println!("listening {}", listener.local_addr().map_err(|e| e.to_string())?);
    std::io::stdout().flush().ok();
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        std::thread::spawn(move || {
            let mut buf = [0u8; 64 * 1024];
            loop {
                match std::io::Read::read(&mut stream, &mut buf) {
                    Ok(0) | Err(_) => return,
                    Ok(n) => {
                        if stream.write_all(&buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }
    Ok(())
}

fn connect(addr: SocketAddr, count: u32) -> Result<(), String> {
    for i in 0..count {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .map_err(|e| format!("connect {addr} (#{i}): {e}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let line = format!("ping {i}\n");
        stream.write_all(line.as_bytes()).map_err(|e| format!("write: {e}"))?;
        let mut echoed = String::new();
        BufReader::new(&stream).read_line(&mut echoed).map_err(|e| format!("read: {e}"))?;
        if echoed != line {
            return Err(format!("echo mismatch: sent {line:?}, got {echoed:?}"));
        }
    }
    println!("ok {count}");
    Ok(())
}
