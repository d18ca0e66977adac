"""BytePS-compatible front ends for gradlink: `import gradlink.byteps.torch as bps`."""
