// libgradlink.so has no code of its own: it is gradlink's module archives linked whole
// (CMakeLists.txt, target `gradlink`), one copy for every Python module of a process.
